"""Multi-turn (agentic) rollouts over several workers, placed for prefix locality.

    pool = LocalRolloutPool(2, lambda: model, config)
    run = run_trajectories(pool, first_prompts, observe, num_turns=4, sampling=sampling,
                           placement=TurnPlacement.STICKY)
    run.prefix_hit_tokens, run.prefill_tokens

A trajectory is a conversation with an environment: turn t's prompt is turn t-1's prompt, its
completion and the environment's answer to it (`observe`: a tool's output, a user's reply).
Every turn's prompt therefore opens with all of the previous turn's computed tokens, whose KV
pages the worker that ran that turn keeps in its prefix cache once the turn ends.
`TurnPlacement.STICKY` sends every turn of a trajectory to the worker that ran its first one
(trajectories dealt out in turn), so each turn prefills only what is new since the last;
`TurnPlacement.BLIND` moves turn t of trajectory j to worker (j + t) mod the number of
workers, as a locality-blind balancer would, so each turn prefills the whole conversation
again. Turns run in rounds (turn t of every trajectory at once, the workers in lockstep).

Turn t of trajectory j is sampled with seed `seed + t * num_trajectories + j` wherever it runs,
so placement changes what is prefilled, never a token.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence

from kvjax.rl.workers import RolloutPool, SampleSlice
from kvjax.sampling import SamplingParams

# The environment: (trajectory index, turn index, that turn's completion) -> the tokens it
# answers with, which follow the completion in the next turn's prompt.
Observe = Callable[[int, int, list[int]], list[int]]


class TurnPlacement(enum.Enum):
    """Which worker runs each turn of a trajectory.

    STICKY: every turn on its trajectory's home worker (trajectory j's is j mod workers),
      which holds the pages of the conversation so far.
    BLIND: turn t of trajectory j on worker (j + t) mod workers: never where the last turn ran
      (with two or more workers).
    """

    STICKY = "sticky"
    BLIND = "blind"


def turn_workers(num_trajectories: int, turn: int, num_workers: int,
                 placement: TurnPlacement) -> list[int]:
    """The worker of turn `turn` of each trajectory."""
    shift = turn if TurnPlacement(placement) is TurnPlacement.BLIND else 0
    return [(j + shift) % num_workers for j in range(num_trajectories)]


@dataclasses.dataclass(frozen=True)
class TrajectoryRun:
    """Multi-turn rollouts as they ran.

    Attributes:
      prompts: [trajectory][turn] the turn's prompt ids.
      completions: [trajectory][turn] the turn's sampled ids.
      workers: [trajectory][turn] the worker that ran it.
      prefill_tokens: prompt tokens the workers computed over the run.
      prefix_hit_tokens: prompt tokens the workers' prefix caches supplied.
      wall_s: seconds the run took.
    """

    prompts: list[list[list[int]]]
    completions: list[list[list[int]]]
    workers: list[list[int]]
    prefill_tokens: int
    prefix_hit_tokens: int
    wall_s: float

    @property
    def prefix_hit_rate(self) -> float:
        """The share of prompt tokens the prefix caches supplied."""
        total = self.prefill_tokens + self.prefix_hit_tokens
        return self.prefix_hit_tokens / total if total else 0.0


def run_trajectories(pool: RolloutPool, first_prompts: Sequence[Sequence[int]],
                     observe: Observe, *, num_turns: int, sampling: SamplingParams,
                     placement: TurnPlacement, seed: int = 0,
                     name: str = "agentic") -> TrajectoryRun:
    """Runs `num_turns` turns of one trajectory per first prompt over the pool's workers."""
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns!r}")
    if not first_prompts or any(len(p) == 0 for p in first_prompts):
        raise ValueError("every trajectory needs a non-empty first prompt")
    if sampling.n != 1:
        raise ValueError(f"a trajectory's turn is one sample: n must be 1, got {sampling.n}")
    num = len(first_prompts)
    prompts = [[[int(t) for t in p]] for p in first_prompts]
    completions: list[list[list[int]]] = [[] for _ in range(num)]
    workers: list[list[int]] = [[] for _ in range(num)]
    before = pool.stats()
    start = time.perf_counter()
    for turn in range(num_turns):
        placed = turn_workers(num, turn, pool.num_workers, placement)
        parts: list[list[SampleSlice]] = [[] for _ in range(pool.num_workers)]
        for j, w in enumerate(placed):
            parts[w].append(SampleSlice(j, prompts[j][turn], 0, 1))
            workers[j].append(w)
        pool.start_slices(parts, sampling, group_size=1, seed=seed + turn * num,
                          name=f"{name}/turn{turn}")
        while not pool.step():
            pass
        for sample in pool.samples():
            j = sample.prompt_index
            completions[j].append(sample.completion_ids)
            if turn + 1 < num_turns:
                answer = [int(t) for t in observe(j, turn, list(sample.completion_ids))]
                prompts[j].append(prompts[j][turn] + sample.completion_ids + answer)
    after = pool.stats()
    return TrajectoryRun(prompts=prompts, completions=completions, workers=workers,
                         prefill_tokens=after["prefill_tokens"] - before["prefill_tokens"],
                         prefix_hit_tokens=after["prefix_hit_tokens"]
                         - before["prefix_hit_tokens"],
                         wall_s=time.perf_counter() - start)
