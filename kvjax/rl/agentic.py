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
again. `TurnPlacement.MIGRATE` is STICKY until the workers' loads drift apart: trajectories
may run different numbers of turns (`num_turns` per trajectory), so as short ones end, one
worker is left with more live trajectories than another. Before a round, while the busiest
worker has more than `max_imbalance` live trajectories over the least busy one, its
longest-running trajectory (the longest conversation) moves there, and the pages of its
conversation held by the old worker's prefix cache are copied into the new one's
(`RolloutPool.move_pages`), so its next turn hits them there.

The old worker keeps its copy, unpinned in its prefix cache, for its LRU to reclaim when it
needs the room. Dropping it at once would gain nothing (an unpinned cached page is reclaimed on
demand) and would lose the one copy that is certain to be there: when the new worker has no
free pages for the import, the move is called off and the trajectory stays where its pages
are. Pages are content-addressed (the tokens' hash chain under the KV provenance) and a
conversation only grows, so a stale copy is never wrong, only unused.

Turns run in rounds (turn t of every live trajectory at once, the workers in lockstep).
`parallel_s` sums each round's slowest worker's stepping time and the round's page moves: the
rollout time of workers that run side by side, which in-process workers taking turns on the
host do not show.

Turn t of trajectory j is sampled with seed `seed + t * num_trajectories + j` wherever it runs,
so placement changes what is prefilled, never a token.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.engine.kv_transfer import ImportResult
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
    MIGRATE: as STICKY, but a long-running trajectory moves, with its pages, from the busiest
      worker to the least busy one when their loads drift apart.
    """

    STICKY = "sticky"
    BLIND = "blind"
    MIGRATE = "migrate"


def turn_workers(num_trajectories: int, turn: int, num_workers: int,
                 placement: TurnPlacement) -> list[int]:
    """The worker of turn `turn` of each trajectory."""
    shift = turn if TurnPlacement(placement) is TurnPlacement.BLIND else 0
    return [(j + shift) % num_workers for j in range(num_trajectories)]


@dataclasses.dataclass(frozen=True)
class Migration:
    """One trajectory moved between workers before a round.

    Attributes:
      turn: the first turn it runs on `target`.
      trajectory: which trajectory.
      source, target: the workers it left and joined.
      kv_bytes: KV bytes written into `target`'s pages (0 when none was cached on `source`).
      moved_tokens: conversation tokens whose pages came with it.
    """

    turn: int
    trajectory: int
    source: int
    target: int
    kv_bytes: int
    moved_tokens: int


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
      parallel_s: per round, the slowest worker's stepping seconds and the page moves' seconds,
        summed.
      migrations: the trajectories moved (MIGRATE only), in order.
    """

    prompts: list[list[list[int]]]
    completions: list[list[list[int]]]
    workers: list[list[int]]
    prefill_tokens: int
    prefix_hit_tokens: int
    wall_s: float
    parallel_s: float = 0.0
    migrations: tuple[Migration, ...] = ()

    @property
    def kv_bytes_moved(self) -> int:
        """KV bytes the migrations wrote into their new workers."""
        return sum(m.kv_bytes for m in self.migrations)

    @property
    def prefix_hit_rate(self) -> float:
        """The share of prompt tokens the prefix caches supplied."""
        total = self.prefill_tokens + self.prefix_hit_tokens
        return self.prefix_hit_tokens / total if total else 0.0


def run_trajectories(pool: RolloutPool, first_prompts: Sequence[Sequence[int]],
                     observe: Observe, *, num_turns: int | Sequence[int],
                     sampling: SamplingParams, placement: TurnPlacement, seed: int = 0,
                     max_imbalance: int = 1, name: str = "agentic") -> TrajectoryRun:
    """Runs one trajectory per first prompt over the pool's workers.

    `num_turns` is every trajectory's number of turns, or one per trajectory. Under MIGRATE,
    a trajectory moves when the workers' live trajectories differ by more than
    `max_imbalance`; the pool's workers compile their page moves first.
    """
    placement = TurnPlacement(placement)
    turns = _turn_counts(num_turns, len(first_prompts))
    if not first_prompts or any(len(p) == 0 for p in first_prompts):
        raise ValueError("every trajectory needs a non-empty first prompt")
    if sampling.n != 1:
        raise ValueError(f"a trajectory's turn is one sample: n must be 1, got {sampling.n}")
    if not isinstance(max_imbalance, int) or max_imbalance < 1:
        raise ValueError(f"max_imbalance must be an int >= 1, got {max_imbalance!r}")
    num = len(first_prompts)
    prompts = [[[int(t) for t in p]] for p in first_prompts]
    completions: list[list[list[int]]] = [[] for _ in range(num)]
    workers: list[list[int]] = [[] for _ in range(num)]
    homes = turn_workers(num, 0, pool.num_workers, placement)
    migrations: list[Migration] = []
    if placement is TurnPlacement.MIGRATE:
        pool.warm_migration()
    before = pool.stats()
    parallel_s = 0.0
    start = time.perf_counter()
    for turn in range(max(turns)):
        live = [j for j in range(num) if turns[j] > turn]
        if placement is TurnPlacement.BLIND:
            homes = turn_workers(num, turn, pool.num_workers, placement)
        elif placement is TurnPlacement.MIGRATE:
            moving = time.perf_counter()  # the moves hold the round back: they count
            migrations += _rebalance(pool, homes, live, prompts, turn, max_imbalance)
            parallel_s += time.perf_counter() - moving
        parts: list[list[SampleSlice]] = [[] for _ in range(pool.num_workers)]
        for j in live:
            parts[homes[j]].append(SampleSlice(j, prompts[j][turn], 0, 1))
            workers[j].append(homes[j])
        busy = [s["busy_ms"] for s in pool.worker_stats()]
        pool.start_slices(parts, sampling, group_size=1, seed=seed + turn * num,
                          name=f"{name}/turn{turn}")
        while not pool.step():
            pass
        parallel_s += max(s["busy_ms"] - b for s, b in zip(pool.worker_stats(), busy,
                                                             strict=True)) / 1000
        for sample in pool.samples():
            j = sample.prompt_index
            completions[j].append(sample.completion_ids)
            if turn + 1 < turns[j]:
                answer = [int(t) for t in observe(j, turn, list(sample.completion_ids))]
                prompts[j].append(prompts[j][turn] + sample.completion_ids + answer)
    after = pool.stats()
    return TrajectoryRun(prompts=prompts, completions=completions, workers=workers,
                         prefill_tokens=after["prefill_tokens"] - before["prefill_tokens"],
                         prefix_hit_tokens=after["prefix_hit_tokens"]
                         - before["prefix_hit_tokens"],
                         wall_s=time.perf_counter() - start, parallel_s=parallel_s,
                         migrations=tuple(migrations))


def _turn_counts(num_turns: int | Sequence[int], num_trajectories: int) -> list[int]:
    """Each trajectory's number of turns; ValueError unless each is an int >= 1."""
    turns = ([num_turns] * num_trajectories if isinstance(num_turns, int)
             else list(num_turns))
    if len(turns) != num_trajectories or any(not isinstance(t, int) or t < 1 for t in turns):
        raise ValueError(f"num_turns must be >= 1, one count or one per trajectory "
                         f"({num_trajectories}), got {num_turns!r}")
    return turns


def _rebalance(pool: RolloutPool, homes: list[int], live: list[int],
               prompts: list[list[list[int]]], turn: int,
               max_imbalance: int) -> list[Migration]:
    """Moves live trajectories (updating `homes`) until the live loads differ by at most
    `max_imbalance`; each move lowers the gap by two, so this ends."""
    moved = []
    while True:
        loads = [0] * pool.num_workers
        for j in live:
            loads[homes[j]] += 1
        busiest, idlest = int(np.argmax(loads)), int(np.argmin(loads))
        if loads[busiest] - loads[idlest] <= max_imbalance:
            return moved
        j = max((j for j in live if homes[j] == busiest), key=lambda j: len(prompts[j][turn]))
        result: ImportResult = pool.move_pages(prompts[j][turn], busiest, idlest)
        if result.is_fallback:  # No room on the target: the trajectory stays with its pages.
            return moved
        homes[j] = idlest
        moved.append(Migration(turn, j, busiest, idlest, result.moved_bytes,
                               result.transferred_tokens))
