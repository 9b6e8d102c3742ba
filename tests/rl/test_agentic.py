"""Multi-turn trajectories over rollout workers: sticky placement keeps a trajectory's turns
where its pages are, migration moves a trajectory with its pages when loads drift apart, and
placement never changes a token.

Oracles: the dense forward pass over each whole conversation for every turn's greedy tokens
(whatever the placement), and a brute-force prefix cache (per worker, every page-aligned prefix
of the tokens it computed in earlier turns, plus what a migration copied in) for the prompt
tokens the prefix caches supply.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.rl.agentic import TurnPlacement, run_trajectories, turn_workers
from kvjax.rl.workers import LocalRolloutPool
from kvjax.testing import TINY, dense_logprobs, tiny_model

PAGE = 4
# One prefill chunk size and at most 2 rows (2 of the 3 trajectories share a worker): few
# step shapes to compile.
CONFIG = EngineConfig(page_size=PAGE, num_pages=256, max_num_batched_tokens=64,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_num_seqs=2)
SAMPLING = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
NUM_TURNS = 4


def observe(trajectory: int, turn: int, completion: list[int]) -> list[int]:
    """A tool's answer: three tokens that depend on the call (the completion)."""
    return [(sum(completion) + 7 * trajectory + turn + k) % 120 for k in range(3)]


def brute_force_hits(prompts, completions, workers, migrations=()) -> int:
    """Prompt tokens a prefix cache of full pages supplies: per worker, the longest
    page-aligned prefix (never the prompt's last token) of the turn's prompt among the tokens
    computed there in earlier turns (each prompt and its completion but the last token), or
    copied there by a migration (the longest such prefix the old worker held)."""
    held: dict[int, set[tuple[int, ...]]] = {}

    def longest(prompt, w):
        pages = (len(prompt) - 1) // PAGE
        return max(k for k in range(pages + 1)
                   if k == 0 or tuple(prompt[:k * PAGE]) in held.get(w, set()))

    hits = 0
    for turn in range(max(map(len, prompts))):
        for m in migrations:
            if m.turn == turn:
                prompt = prompts[m.trajectory][turn]
                held.setdefault(m.target, set()).update(
                    tuple(prompt[:k * PAGE]) for k in range(1, longest(prompt, m.source) + 1))
        done = []
        for j in range(len(prompts)):
            if turn >= len(prompts[j]):
                continue
            prompt, w = prompts[j][turn], workers[j][turn]
            hits += longest(prompt, w) * PAGE
            computed = prompt + completions[j][turn][:-1]
            done.append((w, computed))
        for w, computed in done:  # one round's turns run at once: none hits another
            held.setdefault(w, set()).update(tuple(computed[:k * PAGE])
                                             for k in range(1, len(computed) // PAGE + 1))
    return hits


def check_turns(model, run) -> None:
    """Every turn's tokens are greedy under the dense forward pass over the whole
    conversation, and each prompt is the last turn's with the tool's answer."""
    for j in range(len(run.prompts)):
        final = run.prompts[j][-1] + run.completions[j][-1]
        greedy = dense_logprobs(model, final).argmax(-1)
        for turn in range(len(run.prompts[j])):
            start = len(run.prompts[j][turn])
            completion = run.completions[j][turn]
            assert completion == list(greedy[start - 1:start - 1 + len(completion)])
            assert final[start:start + len(completion)] == completion
            if turn:
                assert run.prompts[j][turn] == (run.prompts[j][turn - 1]
                                                + run.completions[j][turn - 1]
                                                + observe(j, turn - 1,
                                                          run.completions[j][turn - 1]))
    total = sum(len(p) for turns in run.prompts for p in turns)
    assert run.prefill_tokens + run.prefix_hit_tokens == total


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def pool(model):
    return LocalRolloutPool(2, lambda: model, CONFIG)


def test_turn_placement():
    assert turn_workers(3, 2, 2, TurnPlacement.STICKY) == [0, 1, 0]
    assert turn_workers(3, 1, 2, TurnPlacement.BLIND) == [1, 0, 1]


def test_sticky_turns_hit_their_pages_and_placement_changes_no_token(model, pool):
    rng = np.random.default_rng(3)
    firsts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (9, 14, 6)]
    runs = {}
    for offset, placement in enumerate((TurnPlacement.STICKY, TurnPlacement.BLIND)):
        # Each run's trajectories open with their own first page: no run hits another's pages.
        opened = [[120 + offset] + first for first in firsts]
        runs[placement] = run_trajectories(pool, opened, observe, num_turns=NUM_TURNS,
                                           sampling=SAMPLING, placement=placement, seed=5)
    sticky, blind = runs[TurnPlacement.STICKY], runs[TurnPlacement.BLIND]
    for run in runs.values():
        check_turns(model, run)
        assert run.prefix_hit_tokens == brute_force_hits(run.prompts, run.completions,
                                                         run.workers)
        assert not run.migrations
    assert sticky.prefix_hit_tokens > blind.prefix_hit_tokens
    assert sticky.prefix_hit_rate > blind.prefix_hit_rate


def test_bad_trajectories_are_refused():
    with pytest.raises(ValueError, match="num_turns"):
        run_trajectories(None, [[1]], observe, num_turns=0, sampling=SAMPLING,
                         placement=TurnPlacement.STICKY)
    with pytest.raises(ValueError, match="n must be 1"):
        run_trajectories(None, [[1]], observe, num_turns=1,
                         sampling=SamplingParams(n=2), placement=TurnPlacement.STICKY)
    with pytest.raises(ValueError, match="one per trajectory"):
        run_trajectories(None, [[1], [2]], observe, num_turns=[2], sampling=SAMPLING,
                         placement=TurnPlacement.MIGRATE)
    with pytest.raises(ValueError, match="max_imbalance"):
        run_trajectories(None, [[1]], observe, num_turns=1, sampling=SAMPLING,
                         placement=TurnPlacement.MIGRATE, max_imbalance=0)


def test_migrated_trajectory_hits_its_moved_pages_on_the_new_worker(model, pool):
    # Trajectory 1 ends after one turn: worker 1 idles while worker 0 holds trajectories 0
    # and 2, so before turn 1 the longer of them moves to worker 1 with its pages.
    turns = [4, 1, 4]
    rng = np.random.default_rng(4)
    firsts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (9, 14, 6)]
    compiles = None
    for offset in (3, 4):  # the second run is in steady state: nothing compiles
        opened = [[120 + offset] + first for first in firsts]
        run = run_trajectories(pool, opened, observe, num_turns=turns, sampling=SAMPLING,
                               placement=TurnPlacement.MIGRATE, seed=5)
        if compiles is not None:
            assert pool.num_compiles() == compiles
        compiles = pool.num_compiles()
    check_turns(model, run)
    assert [len(c) for c in run.completions] == turns
    (m,) = run.migrations
    assert (m.turn, m.source, m.target) == (1, 0, 1)
    assert m.trajectory == (0 if len(run.prompts[0][1]) >= len(run.prompts[2][1]) else 2)
    assert run.workers[m.trajectory] == [0, 1, 1, 1]
    # Every full page of the conversation the old worker held came, and only those.
    held = (len(run.prompts[m.trajectory][0]) + len(run.completions[m.trajectory][0]) - 1)
    assert m.moved_tokens == held // PAGE * PAGE > 0
    assert m.kv_bytes == m.moved_tokens * 2 * TINY.num_layers * TINY.num_kv_heads * (
        TINY.head_dim * np.dtype(np.float32).itemsize)
    assert run.kv_bytes_moved == m.kv_bytes
    # The next turn on the new worker hit the moved pages: the brute-force cache without the
    # copy finds fewer hits than the workers report.
    hits = brute_force_hits(run.prompts, run.completions, run.workers, run.migrations)
    assert run.prefix_hit_tokens == hits
    assert hits - brute_force_hits(run.prompts, run.completions, run.workers) == m.moved_tokens
    # Nothing leaks: no page stays pinned on either worker, and every page is allocatable
    # (the old worker's copy waits in its prefix cache for the LRU).
    for worker in pool.workers:
        allocator = worker.engine.allocator
        assert allocator.num_used_pages() == 0
        assert allocator.num_free_pages() == allocator.capacity
