"""One byte budget shared by several models: KV frames and resident weights.

The device holds one arena of `num_frames` frames (`kvjax.kv.arena`); every model's page is one
frame, so a frame one model frees can become a page of another. The budget covers the frames
in use and the weights of the models whose weights are on the device:

    frames_in_use * frame_bytes + resident_weight_bytes <= budget_bytes     (at every step)

`FramePool` keeps that ledger on the host and hands each model's block manager its frames
through an `OwnerPages` page source. When a model needs a frame and the budget has none, the
pool asks its `reclaim` hook (set by the multi-model engine) to make room: other models' cold
prefix pages, then idle models' weights, in the order a `PoolPolicy` chooses.

Policies (registry `POOL_POLICIES`):

  * `static`: the baseline. Every model's weights stay resident and the rest of the budget is
    split into equal fixed KV shares; nothing moves between models.
  * `elastic`: frames go to whichever model asks; when the budget is full, the least recently
    active other model gives way first, its cached prefix pages and then, once it has no
    request in flight, its weights (moved to host memory).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import ClassVar, Protocol

from kvjax.registry import Registry


@dataclasses.dataclass
class Owner:
    """One model's account in the pool.

    Attributes:
      name: the model's name.
      weight_bytes: device bytes of its weights.
      weights_resident: whether they are on the device (counted in the budget).
      frames: frames it holds (in use or cached).
      last_active: the pool clock (a counter) when it last took a frame or was marked active.
      evictable: () -> its cached pages nobody references; give_back: (n) -> returns up to n
        of them to the pool (set when its block manager is built).
      is_idle: () -> whether it has nothing in flight (its weights may then leave the device).
    """

    name: str
    weight_bytes: int
    weights_resident: bool = True
    frames: int = 0
    last_active: int = 0
    evictable: Callable[[], int] = lambda: 0
    give_back: Callable[[int], int] = lambda n: 0
    is_idle: Callable[[], bool] = lambda: True


class PoolPolicy(Protocol):
    """Which model's memory gives way when another needs it (chosen by name)."""

    name: ClassVar[str]
    is_elastic: ClassVar[bool]  # False: fixed shares, no reclaim across models, no offload

    def quota(self, pool: FramePool, owner: Owner) -> int | None:
        """The most frames `owner` may hold, or None for no limit beyond the budget."""

    def give_way(self, pool: FramePool, requester: str) -> list[Owner]:
        """The other owners whose memory may go to `requester`, first to give way first."""


class StaticPartition:
    """Every model keeps its weights; the budget left for KV is split into equal shares."""

    name: ClassVar[str] = "static"
    is_elastic: ClassVar[bool] = False

    def quota(self, pool: FramePool, owner: Owner) -> int | None:
        weights = sum(o.weight_bytes for o in pool.owners.values())
        share = (pool.budget_bytes - weights) // max(len(pool.owners), 1)
        return max(share // pool.frame_bytes, 0)

    def give_way(self, pool: FramePool, requester: str) -> list[Owner]:
        return []


class ElasticLRU:
    """Any model takes any free frame; the least recently active other models give way."""

    name: ClassVar[str] = "elastic"
    is_elastic: ClassVar[bool] = True

    def quota(self, pool: FramePool, owner: Owner) -> int | None:
        return None

    def give_way(self, pool: FramePool, requester: str) -> list[Owner]:
        others = [o for o in pool.owners.values() if o.name != requester]
        return sorted(others, key=lambda o: o.last_active)


POOL_POLICIES = Registry.of("pool policy", StaticPartition, ElasticLRU)


def register_pool_policy(cls: type) -> type:
    """Registers a `PoolPolicy` class under its `name` (usable as a decorator)."""
    return POOL_POLICIES.add(cls)


def make_pool_policy(name: str) -> PoolPolicy:
    return POOL_POLICIES.make(name)


class FramePool:
    """The host ledger of one arena's frames and the weights resident beside them.

    Attributes:
      budget_bytes: the device bytes KV frames and resident weights share.
      frame_bytes: bytes of one frame.
      num_frames: frames of the arena (budget_bytes // frame_bytes): ids 0 .. num_frames - 1.
      policy: the `PoolPolicy`.
      owners: name -> `Owner`.
      reclaim: (requester, frames) -> frames it freed; the multi-model engine's hook, called
        when the budget has no frame for `requester` (None: nothing is reclaimed).
    """

    def __init__(self, budget_bytes: int, frame_bytes: int, policy: PoolPolicy):
        if frame_bytes <= 0 or budget_bytes < frame_bytes:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no frame of {frame_bytes} "
                             f"bytes")
        self.budget_bytes = budget_bytes
        self.frame_bytes = frame_bytes
        self.num_frames = budget_bytes // frame_bytes
        self.policy = policy
        self.owners: dict[str, Owner] = {}
        self.reclaim: Callable[[str, int], int] | None = None
        self._free = collections.deque(range(self.num_frames))
        self._clock = 0

    # ----------------------------------------------------------------------------- accounts

    def add_owner(self, name: str, weight_bytes: int) -> Owner:
        """Opens `name`'s account with its weights resident (ValueError if they cannot be)."""
        if name in self.owners:
            raise ValueError(f"model {name!r} is already in the pool")
        owner = self.owners[name] = Owner(name, int(weight_bytes), weights_resident=False)
        return owner

    def pages(self, name: str) -> OwnerPages:
        """The page source of `name`'s block manager."""
        return OwnerPages(self, self.owners[name])

    @property
    def frames_in_use(self) -> int:
        return self.num_frames - len(self._free)

    @property
    def resident_weight_bytes(self) -> int:
        return sum(o.weight_bytes for o in self.owners.values() if o.weights_resident)

    @property
    def used_bytes(self) -> int:
        """KV frames held plus resident weights: never above budget_bytes."""
        return self.frames_in_use * self.frame_bytes + self.resident_weight_bytes

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def touch(self, name: str) -> None:
        """Marks `name` as just active (the elastic policy evicts the least recent first)."""
        self._clock += 1
        self.owners[name].last_active = self._clock

    def set_weights_resident(self, name: str, resident: bool) -> None:
        """Records that `name`'s weights moved; ValueError if loading them breaks the budget."""
        owner = self.owners[name]
        if resident and not owner.weights_resident and owner.weight_bytes > self.free_bytes:
            raise ValueError(f"model {name!r}: {owner.weight_bytes} bytes of weights do not fit "
                             f"beside {self.used_bytes} of {self.budget_bytes} bytes in use")
        owner.weights_resident = resident

    # ----------------------------------------------------------------------------- frames

    def num_free_for(self, owner: Owner) -> int:
        """Frames `owner` can take now without anything else giving way."""
        free = min(len(self._free), self.free_bytes // self.frame_bytes)
        quota = self.policy.quota(self, owner)
        return free if quota is None else max(min(free, quota - owner.frames), 0)

    def capacity_for(self, owner: Owner) -> int:
        """The most frames `owner` can hold: its quota, or the budget less its own weights."""
        quota = self.policy.quota(self, owner)
        most = (self.budget_bytes - owner.weight_bytes) // self.frame_bytes
        return most if quota is None else min(quota, most)

    def num_reclaimable_for(self, owner: Owner) -> int:
        """Frames other owners could give `owner`: their cached pages, and the room their
        weights take while they are idle (0 under a static policy)."""
        if not self.policy.is_elastic:
            return 0
        others = self.policy.give_way(self, owner.name)
        idle_bytes = sum(o.weight_bytes for o in others if o.weights_resident and o.is_idle())
        return sum(o.evictable() for o in others) + idle_bytes // self.frame_bytes

    def take(self, owner: Owner) -> int | None:
        """A frame for `owner`, making room through `reclaim` when the budget is full."""
        if self.num_free_for(owner) == 0 and self.reclaim is not None:
            self.reclaim(owner.name, 1)
        if self.num_free_for(owner) == 0:
            return None
        owner.frames += 1
        self.touch(owner.name)
        return self._free.popleft()

    def give(self, owner: Owner, frame: int) -> None:
        if not 0 <= frame < self.num_frames:
            raise ValueError(f"frame {frame} is outside [0, {self.num_frames})")
        owner.frames -= 1
        self._free.append(frame)

    def give_way_cached(self, requester: str, num_frames: int) -> int:
        """Other owners' cached pages, in the policy's order, returned until `num_frames`
        frames came back; returns how many did."""
        freed = 0
        for owner in self.policy.give_way(self, requester):
            if freed >= num_frames:
                break
            freed += owner.give_back(num_frames - freed)
        return freed


@dataclasses.dataclass
class OwnerPages:
    """One model's view of the pool: the `PageSource` of its block manager. Its page ids are
    frame ids, so its block tables index the shared arena directly."""

    pool: FramePool
    owner: Owner

    def num_free(self) -> int:
        """Frames it can take now, counting other models' cached pages that would give way."""
        return self.pool.num_free_for(self.owner) + min(
            self.pool.num_reclaimable_for(self.owner),
            self._quota_left())

    def _quota_left(self) -> int:
        quota = self.pool.policy.quota(self.pool, self.owner)
        return 1 << 30 if quota is None else max(quota - self.owner.frames, 0)

    def take(self) -> int | None:
        return self.pool.take(self.owner)

    def give(self, page: int) -> None:
        self.pool.give(self.owner, page)

    def capacity(self) -> int:
        return self.pool.capacity_for(self.owner)
