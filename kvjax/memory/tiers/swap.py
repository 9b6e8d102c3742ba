"""The engine's swap space with tiers on."""

from __future__ import annotations

from collections.abc import Hashable

from kvjax.memory.tiers.manager import TierManager


class TieredSwapSpace:
    """The engine's swap space with tiers on: swapped pages go through checked tier transfers.

    It keeps the interface of kvjax.engine.swap.HostSwapSpace that the engine calls on
    preemption and on finishing (`swap_out`, `drop`, `scrub`, `num_compiles`); swapping back in
    is asynchronous, through `TierManager.load`. Per-sequence state beside the pages (KIVI's
    exact windows) is small: the KV cache manager swaps it as data into a host slot of the
    plain swap space (`KVOpKind.SWAP_OUT` / `SWAP_IN` of no pages, applied in the step's
    dispatch), and writes it back when the sequence is registered again, ahead of its page
    loads (`kvjax.memory.swapping.SwapMoves.restore_window`).

    Attributes:
        tiers: the TierManager.
    """

    def __init__(self, tiers: TierManager, plain, allocator):
        self.tiers = tiers
        self._plain = plain
        self._allocator = allocator

    @property
    def keeps_windows(self) -> bool:
        return self._plain.keeps_windows

    @property
    def memory_kind(self) -> str | None:
        return self.tiers.memory_kind

    @property
    def num_compiles(self) -> int:
        return self._plain.num_compiles + self.tiers.num_compiles

    def swap_out(self, kv, seq_id: Hashable, pages: list[int], *, demote_bits: int = 0) -> int:
        """Issues the copy of a registered sequence's `pages` to the tiers; returns bytes.
        The tiers keep pages in the pool's own codec (their checksums and layouts are per
        page): `demote_bits` is refused."""
        if demote_bits:
            raise ValueError(f"sequence {seq_id!r}: the host tier stores pages in the pool's "
                             f"codec; demoted swap copies need the plain swap space")
        return self.tiers.swap_out(kv, seq_id, pages,
                                   cache_key=self._allocator.cache_key_of(seq_id))

    def page_bytes(self, kv, bits: int = 0) -> int:
        return self._plain.page_bytes(kv, bits)

    def window_bytes(self, kv) -> int:
        """Bytes of one sequence's window in its host slot."""
        return self._plain.window_bytes(kv)

    def copy_window(self, kv, src_slot: int, dst_slot: int):
        return self._plain.copy_window(kv, src_slot, dst_slot)

    def drop(self, seq_id: Hashable) -> None:
        """Forgets a sequence's copy in the tiers (a window's host slot is dropped as data)."""
        self.tiers.drop(seq_id)

    def take_released_slots(self) -> list[int]:
        return self._plain.take_released_slots()

    def scrub(self, kv, pages, seq_slots=()):
        return self._plain.scrub(kv, pages, seq_slots)

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool,
               demote_bits: tuple[int, ...] = ()):
        """The scrub (and window) programs; page swaps go through the tiers, which warm up
        their own."""
        if not self.keeps_windows:
            return self._plain.warmup(kv, max_pages, swap=False, scrub=scrub)
        return self._plain.warmup(kv, max_pages, swap=swap, scrub=scrub, swap_pages=False)
