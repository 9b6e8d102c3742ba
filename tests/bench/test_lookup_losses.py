"""Why prefix lookups stop short, counted from the KV trace (`trace_report.lookup_losses`).

A tiny scenario on a real block manager and the mixed pool's `RoundedPages` (host data
only), traced, against a count made by hand from what the test did: which lookups stopped at
a page demoted in place, at an evicted one, at one never computed, and which demoted pages a
later lookup wanted.
"""

from __future__ import annotations

import itertools

from kvjax.bench import trace_report
from kvjax.memory.block_manager import AllocStatus, BlockManager
from kvjax.memory.precision import RoundedPages
from kvjax.trace import Tracer

P = 4


def test_lookup_losses_match_a_hand_count_of_demoted_evicted_and_never_cached_stops():
    ticks = itertools.count()
    tracer = Tracer(clock=lambda: float(next(ticks)))
    blocks = BlockManager(8, P, enable_prefix_cache=True)
    blocks.tracer = tracer
    rounded = RoundedPages(blocks)

    def serve(seq_id: str, tokens: list[int], num_pages: int) -> int:
        hit = blocks.add_sequence(seq_id, tokens)
        assert blocks.ensure_writable(seq_id, hit, num_pages * P)[0] is AllocStatus.OK
        blocks.commit(seq_id, tokens[:num_pages * P])
        return hit

    prompt = list(range(100, 100 + 4 * P)) + [1]  # 4 full pages, then the last token
    assert serve("a", prompt, 4) == 0  # never cached: wants 4 pages, misses 4
    table = blocks.block_table("a")
    rounded.round_pages("a", table[2:4])  # pages 2 and 3 demoted while indexed
    blocks.free("a")
    assert serve("b", prompt, 4) == 2 * P  # stops at the demoted page 2: misses 2
    blocks.free("b")
    other = list(range(500, 500 + 8 * P))
    assert serve("d", other, 8) == 0  # never cached: wants 7 pages (its last token's page
    # is left to compute), misses 7; its 8 pages take the 4 free ones and evict the 4 cached
    assert blocks.stats.evictions == 4
    assert blocks.add_sequence("c", prompt) == 0  # stops at the evicted page 0: misses 4
    blocks.free("c")  # not admitted: looked up again next step, the same sequence
    assert blocks.add_sequence("c", prompt) == 0
    blocks.free("d")
    assert blocks.add_sequence("f", other + [1]) == 8 * P  # every wanted page

    report = trace_report.analyse(tracer.to_chrome())
    assert report["lookup_losses"] == dict(
        lookups=6,
        stopped={"never cached": 2, "demoted": 1, "evicted": 2, "full": 1},
        pages_missed={"never cached": 11, "demoted": 2, "evicted": 8},
        sequences={"never cached": 2, "demoted": 1, "evicted": 1, "full": 1},
        demoted_pages=2, demoted_indexed=2, later_wanted=2, later_wanted_indexed=2)
    assert "demoted" in trace_report.format_losses(report["lookup_losses"])
