"""Multi-turn trajectories over rollout workers: sticky placement keeps a trajectory's turns
where its pages are, and placement never changes a token.

Oracles: the dense forward pass over each whole conversation for every turn's greedy tokens
(whatever the placement), and a brute-force prefix cache (per worker, every page-aligned prefix
of the tokens it computed in earlier turns) for the prompt tokens the prefix caches supply.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.rl.agentic import TurnPlacement, run_trajectories, turn_workers
from kvjax.rl.workers import LocalRolloutPool
from kvjax.testing import dense_logprobs, tiny_model

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


def brute_force_hits(prompts, completions, workers) -> int:
    """Prompt tokens a prefix cache of full pages supplies: per worker, the longest
    page-aligned prefix (never the prompt's last token) of the turn's prompt among the tokens
    computed there in earlier turns (each prompt and its completion but the last token)."""
    held: dict[int, set[tuple[int, ...]]] = {}
    hits = 0
    for turn in range(NUM_TURNS):
        done = []
        for j in range(len(prompts)):
            prompt, w = prompts[j][turn], workers[j][turn]
            pages = (len(prompt) - 1) // PAGE
            hit = max(k for k in range(pages + 1)
                      if k == 0 or tuple(prompt[:k * PAGE]) in held.get(w, set()))
            hits += hit * PAGE
            computed = prompt + completions[j][turn][:-1]
            done.append((w, computed))
        for w, computed in done:  # one round's turns run at once: none hits another
            held.setdefault(w, set()).update(tuple(computed[:k * PAGE])
                                             for k in range(1, len(computed) // PAGE + 1))
    return hits


def test_turn_placement():
    assert turn_workers(3, 2, 2, TurnPlacement.STICKY) == [0, 1, 0]
    assert turn_workers(3, 1, 2, TurnPlacement.BLIND) == [1, 0, 1]


def test_sticky_turns_hit_their_pages_and_placement_changes_no_token():
    model = tiny_model(seed=0)
    rng = np.random.default_rng(3)
    firsts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (9, 14, 6)]
    pool = LocalRolloutPool(2, lambda: model, CONFIG)
    runs = {}
    for offset, placement in enumerate(TurnPlacement):
        # Each run's trajectories open with their own first page: no run hits another's pages.
        opened = [[120 + offset] + first for first in firsts]
        runs[placement] = run_trajectories(pool, opened, observe, num_turns=NUM_TURNS,
                                           sampling=SAMPLING, placement=placement, seed=5)
    sticky, blind = runs[TurnPlacement.STICKY], runs[TurnPlacement.BLIND]
    for run in runs.values():
        for j in range(len(firsts)):
            final = run.prompts[j][-1] + run.completions[j][-1]
            # Every turn's tokens are greedy under the dense forward pass over the whole
            # conversation, and each prompt is the last turn's with the tool's answer.
            greedy = dense_logprobs(model, final).argmax(-1)
            for turn in range(NUM_TURNS):
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
        assert run.prefix_hit_tokens == brute_force_hits(run.prompts, run.completions,
                                                         run.workers)
        assert run.prefill_tokens + run.prefix_hit_tokens == total
    assert sticky.prefix_hit_tokens > blind.prefix_hit_tokens
    assert sticky.prefix_hit_rate > blind.prefix_hit_rate


def test_bad_trajectories_are_refused():
    with pytest.raises(ValueError, match="num_turns"):
        run_trajectories(None, [[1]], observe, num_turns=0, sampling=SAMPLING,
                         placement=TurnPlacement.STICKY)
    with pytest.raises(ValueError, match="n must be 1"):
        run_trajectories(None, [[1]], observe, num_turns=1,
                         sampling=SamplingParams(n=2), placement=TurnPlacement.STICKY)
