"""The engine's swap space with tiers on."""

from __future__ import annotations

from collections.abc import Hashable

from kvjax.memory.tiers.manager import TierManager


class TieredSwapSpace:
    """The engine's swap space with tiers on: swapped pages go through checked tier transfers.

    It keeps the interface of kvjax.engine.swap.HostSwapSpace that the engine calls on
    preemption and on finishing (`swap_out`, `drop`, `scrub`, `num_compiles`); swapping back in
    is asynchronous, through `TierManager.load`.

    Attributes:
        tiers: the TierManager.
    """

    keeps_windows = False  # Tiers move pages only; KIVI's windows never reach them.

    def __init__(self, tiers: TierManager, plain, allocator):
        self.tiers = tiers
        self._plain = plain
        self._allocator = allocator

    @property
    def memory_kind(self) -> str | None:
        return self.tiers.memory_kind

    @property
    def num_compiles(self) -> int:
        return self._plain.num_compiles + self.tiers.num_compiles

    def swap_out(self, kv, seq_id: Hashable, pages: list[int]) -> int:
        """Issues the copy of a registered sequence's `pages` to the tiers; returns bytes."""
        return self.tiers.swap_out(kv, seq_id, pages,
                                   cache_key=self._allocator.cache_key_of(seq_id))

    def drop(self, seq_id: Hashable) -> None:
        self.tiers.drop(seq_id)
        self._plain.drop(seq_id)

    def scrub(self, kv, pages: list[int]):
        return self._plain.scrub(kv, pages)

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool):
        """The scrub programs (swaps go through the tiers, which warm up their own)."""
        del swap
        return self._plain.warmup(kv, max_pages, swap=False, scrub=scrub)
