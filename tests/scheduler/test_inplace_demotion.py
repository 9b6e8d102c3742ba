"""In-place demotion beside the prefix cache: a page the index holds and a lookup has reused
stays exact, so later requests sharing the prompt still hit it, while the sequence's other
cold pages are demoted and the controller is offered only those.

Oracles (host data only, no device): the prefix hit, against a brute-force search over the
pages the test saw committed (their token prefixes), rounded or freed ones left out; the
ledger's bytes, against a count of the held pages at the classes the test saw them demoted to.
"""

from __future__ import annotations

import types

import pytest

from kvjax.kv import mixed
from kvjax.memory.block_manager import AllocStatus, BlockManager, hit_limit
from kvjax.memory.precision import (
    LedgerPages,
    MixedOptions,
    PrecisionLedger,
    RoundedPages,
    num_page_slots,
)
from kvjax.scheduler.inplace import InPlaceDemotion
from kvjax.testing import TINY

P = 4


class _Plan:
    """The KV cache manager as `InPlaceDemotion` sees it (`KVPlan`), collecting its ops."""

    def __init__(self, blocks: BlockManager):
        self.allocator = blocks
        self.rounded = RoundedPages(blocks)
        self.ops = []

    def has_sequence(self, seq_id: str) -> bool:
        return self.allocator.has_sequence(seq_id)

    def block_table(self, seq_id: str) -> list[int]:
        return self.allocator.block_table(seq_id)

    def plan_op(self, op) -> None:
        self.ops.append(op)


def _mixed_pool(keep_hits: int = 1):
    """A 16-page mixed pool of TINY with the prefix cache: (spec, ledger, blocks, plan,
    demotion)."""
    spec = mixed.cache_spec(TINY, P, group=4)
    budget = 16 * spec.page_bytes_at(0, 0)
    ledger = PrecisionLedger(spec, num_page_slots(spec, budget), budget)
    blocks = BlockManager(len(ledger.k_bits), P, enable_prefix_cache=True,
                          pages=LedgerPages(ledger))
    plan = _Plan(blocks)
    demotion = InPlaceDemotion(ledger, plan, MixedOptions(keep_hits=keep_hits).classes(),
                               pad_to=8, keep_hits=keep_hits)
    return spec, ledger, blocks, plan, demotion


def test_reused_prefix_pages_stay_exact_and_later_prompts_hit_them():
    spec, ledger, blocks, plan, demotion = _mixed_pool()
    cache = blocks.prefix_cache
    system = list(range(100, 100 + 3 * P))  # a prompt every request starts with
    content: dict[int, tuple[int, ...]] = {}  # page -> the tokens up to its end, committed
    rounded: set[int] = set()

    def serve(seq_id: str, tokens: list[int], committed: int) -> int:
        hit = blocks.add_sequence(seq_id, tokens)
        assert blocks.ensure_writable(seq_id, hit, len(tokens))[0] is AllocStatus.OK
        blocks.commit(seq_id, tokens[:committed])
        for i, page in enumerate(blocks.block_table(seq_id)[:committed // P]):
            content.setdefault(page, tuple(tokens[:(i + 1) * P]))
        return hit

    def free(seq_id: str) -> None:
        for page in blocks.free(seq_id):
            content.pop(page, None)
            rounded.discard(page)

    def best_hit(tokens: list[int]) -> int:
        """Brute force: the leading full pages some exact committed page holds."""
        exact = {v for p, v in content.items() if p not in rounded}
        n = 0
        while (n + 1) * P <= hit_limit(tokens, None) and tuple(tokens[:(n + 1) * P]) in exact:
            n += 1
        return n * P

    assert serve("a", system + [1] * P + [2], 4 * P + 1) == 0
    free("a")  # its four full pages stay cached, none reused yet
    b = system + [3] * (2 * P) + [4]
    assert serve("b", b, 4 * P) == 3 * P  # a's system pages; b's next full page uncommitted
    table = blocks.block_table("b")
    assert [cache.num_hits(p) for p in table[:4]] == [1, 1, 1, 0]
    assert not cache.is_indexed(table[4])
    seq = types.SimpleNamespace(seq_id="b", num_computed=len(b), inplace_bits=0)
    # The controller is offered the two pages it may demote, not the reused system pages.
    assert demotion.seq_fields(seq) == dict(pages_at={0: 2}, inplace_bits=0)
    assert demotion.apply({"b": 4}, {"b": seq}) == 2
    assert plan.ops[-1].pages == (table[3], table[4])
    rounded.update(plan.ops[-1].pages)
    assert [(int(ledger.k_bits[p]), int(ledger.v_bits[p])) for p in table[:5]] == \
        [(0, 0)] * 3 + [(4, 4)] * 2
    assert [cache.is_indexed(p) for p in table[:5]] == [True] * 3 + [False] * 2
    assert demotion.seq_fields(seq) == dict(pages_at={4: 2}, inplace_bits=4)
    # A later request sharing the prompt hits the system pages b still holds, exact.
    c = system + [3] * P + [5] * P + [6]
    want = best_hit(c)
    assert want == 3 * P and serve("c", c, len(c)) == want
    assert blocks.stats.prefix_hit_tokens == 6 * P
    held = {p for s in ("b", "c") for p in blocks.block_table(s)}
    held |= {c.page for c in cache.cached_pages()}
    exact, int4 = spec.page_bytes_at(0, 0), spec.page_bytes_at(4, 4)
    assert ledger.bytes_held == pytest.approx(
        len(held - rounded) * exact + len(held & rounded) * int4)
    for seq_id in ("b", "c"):
        free(seq_id)
    assert not rounded  # demoted pages go to the free list, never to the cache
    assert ledger.bytes_held == pytest.approx(cache.num_indexed() * exact)
    assert cache.num_indexed() == len(content)


@pytest.mark.parametrize("keep_hits, kept", [(0, 0), (1, 3), (2, 2)])
def test_keep_hits_keeps_exact_only_pages_reused_that_often(keep_hits, kept):
    _, _, blocks, plan, demotion = _mixed_pool(keep_hits)
    x = list(range(100, 100 + 2 * P))  # two pages every prompt starts with
    y, z, w = [7] * P, [8] * P, [9] * P

    def serve(seq_id: str, tokens: list[int]) -> int:
        hit = blocks.add_sequence(seq_id, tokens)
        assert blocks.ensure_writable(seq_id, hit, len(tokens))[0] is AllocStatus.OK
        blocks.commit(seq_id, tokens)
        return hit

    serve("a", x + y + [1])
    blocks.free("a")
    assert serve("b", x + w + [2]) == 2 * P
    blocks.free("b")
    c = x + y + z + [3]
    assert serve("c", c) == 3 * P
    # By hand: x's two pages were reused by b and c, y's by c, z (c's own) by no one.
    table = blocks.block_table("c")[:4]
    hits = [2, 2, 1, 0]
    assert [blocks.prefix_cache.num_hits(p) for p in table] == hits
    demoted = table[sum(h >= keep_hits for h in hits) if keep_hits else 0:]
    assert len(table) - len(demoted) == kept
    seq = types.SimpleNamespace(seq_id="c", num_computed=len(c), inplace_bits=0)
    assert demotion.seq_fields(seq) == dict(pages_at={0: len(demoted)}, inplace_bits=0)
    assert demotion.apply({"c": 8}, {"c": seq}) == len(demoted)
    assert plan.ops[-1].pages == tuple(demoted)
    assert [blocks.prefix_cache.is_indexed(p) for p in table] == [p not in demoted
                                                                  for p in table]
    # A later prompt sharing x + y hits the pages still exact, up to the first demoted one.
    assert blocks.add_sequence("d", x + y + [4]) == min(kept, 3) * P


def test_keep_hits_must_be_an_int_at_least_zero():
    with pytest.raises(ValueError, match="keep_hits=-1"):
        MixedOptions(keep_hits=-1)
