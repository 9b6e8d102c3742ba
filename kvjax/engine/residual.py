"""The engine's side of per-sequence KV beside the pages (a state's sequence-slot leaves).

A KIVI pool (`kvjax.kv.quantized`) keeps each running sequence's most recent tokens exact in
a window slot of its own, beside the pages: its `KVState.seq_slot_leaves`. The allocator hands
out the slots with the sequences (`WindowBlockManager`), and the swap space moves them with the
pages (`WindowSwapSpace`): a swapped-out sequence takes its window to host memory and gets it
back in its new slot, a forked sample starts from a copy of its parent's window, and scrubbing
zeroes the windows of freed sequences as well as their pages.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import jit as kvjax_jit
from kvjax.engine.swap import HostSwapSpace, tree_bytes
from kvjax.kv import pages as kv_pages
from kvjax.memory.block_manager import BlockManager
from kvjax.memory.ops import KVOp
from kvjax.shapes import powers_of_2_up_to


class WindowBlockManager(BlockManager):
    """A block manager that also gives every registered sequence a window slot."""

    def __init__(self, num_pages: int, page_size: int, *, num_seq_slots: int,
                 scrub_windows: bool = False, **options):
        super().__init__(num_pages, page_size, **options)
        self.num_seq_slots = num_seq_slots
        self.scrub_windows = scrub_windows
        self._free_slots = list(range(num_seq_slots - 1, -1, -1))
        self._slot_of: dict[Hashable, int] = {}
        self.released_slots: list[int] = []  # freed since the last scrub (if scrub_windows)

    def seq_slot(self, seq_id: Hashable) -> int:
        """The window slot of a registered sequence."""
        return self._slot_of[seq_id]

    def _take_slot(self, seq_id: Hashable) -> None:
        if not self._free_slots:
            raise RuntimeError(f"no free window slot for {seq_id!r}: all {self.num_seq_slots} "
                               f"are held (the engine admits at most max_num_seqs sequences)")
        slot = self._slot_of[seq_id] = self._free_slots.pop()
        # A slot freed by a registration that fell through (its window never written) waits in
        # `released_slots` for the next scrub, which must not zero its new owner's window.
        if slot in self.released_slots:
            self.released_slots.remove(slot)

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], *,
                     cache_key: bytes = b"", indexable: bool = True,
                     record_stats: bool = True, max_hit: int | None = None) -> int:
        cached = super().add_sequence(seq_id, token_ids, cache_key=cache_key,
                                      indexable=indexable, record_stats=record_stats,
                                      max_hit=max_hit)
        self._take_slot(seq_id)
        return cached

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """As `BlockManager.fork`; ValueError (the child is prefilled afresh) without a slot."""
        if not self._free_slots:
            raise ValueError(f"no free window slot to fork {child_id!r} into")
        super().fork(parent_id, child_id)
        self._take_slot(child_id)

    def free(self, seq_id: Hashable) -> list[int]:
        freed = super().free(seq_id)
        slot = self._slot_of.pop(seq_id)
        self._free_slots.append(slot)
        if self.scrub_windows:
            self.released_slots.append(slot)
        return freed


def _window(kv, slot: jax.Array) -> list[jax.Array]:
    return kv_pages.gather_seq_slots(kv, slot)  # [L, ...] each, e.g. [L, W, K, D]


def _set_window(kv, slot: jax.Array, window: list[jax.Array]):
    return kv_pages.scatter_seq_slots(kv, slot, window)


def _copy_window(kv, src: jax.Array, dst: jax.Array):
    return _set_window(kv, dst, _window(kv, src))


def _zero_windows(kv, slots: jax.Array):
    return kv.with_seq_slot_leaves([x.at[:, slots].set(0) for x in kv.seq_slot_leaves()])


class WindowSwapSpace(HostSwapSpace):
    """Host swap space for a state with sequence-slot leaves (KIVI): pages as `HostSwapSpace`,
    plus each sequence's window (its entries of the sequence-slot leaves).

    Args:
        allocator: the engine's `WindowBlockManager` (which slot a sequence holds).
    """

    keeps_windows = True

    def __init__(self, allocator: WindowBlockManager):
        super().__init__()
        self.allocator = allocator
        # host slot (`KVOp.host_slot`) -> a window copy
        self._windows: dict[Hashable, list[object]] = {}
        self._window = kvjax_jit.jit(_window)
        self._set_window = kvjax_jit.jit(_set_window, donate_argnums=0)
        self._zero_windows = kvjax_jit.jit(_zero_windows, donate_argnums=0)
        self._copy_window = kvjax_jit.jit(_copy_window, donate_argnums=0)

    @property
    def num_compiles(self) -> int:
        return super().num_compiles + sum(
            f.num_compiles for f in (self._window, self._set_window, self._zero_windows,
                                      self._copy_window))

    def swap_out(self, kv, op: KVOp):
        """Copies the pages and the window of slot op.seq_slots[0] to host memory."""
        kv = super().swap_out(kv, op)
        if op.seq_slots:
            window = self._window(kv, jnp.int32(op.seq_slots[0]))
            self._windows[op.host_slot] = [self._to_host(x) for x in window]
        return kv

    def swap_in(self, kv, op: KVOp):
        """Writes the pages back, and the window into slot op.seq_slots[0]."""
        kv = super().swap_in(kv, op)
        window = self._windows.pop(op.host_slot, None)
        if op.seq_slots:
            kv = self._set_window(kv, jnp.int32(op.seq_slots[0]),
                                  [self._to_device(x) for x in window])
        return kv

    def window_bytes(self, kv) -> int:
        """Bytes of one sequence's window in a host copy."""
        return tree_bytes(jax.eval_shape(_window, kv, jnp.int32(0)))

    def drop(self, key) -> None:
        """Frees the host copy under `key` (a host slot), if any."""
        super().drop(key)
        self._windows.pop(key, None)

    def take_released_slots(self) -> list[int]:
        """The window slots of sequences freed since the last call (with scrub_windows)."""
        released = list(self.allocator.released_slots)
        self.allocator.released_slots.clear()
        return released

    def scrub(self, kv, pages: Sequence[int], seq_slots: Sequence[int] = ()):
        """Zeroes freed pages and the windows of freed sequence slots (padded index arrays)."""
        kv = super().scrub(kv, pages)
        if len(seq_slots):
            kv = self._zero_windows(kv, np.asarray(seq_slots, np.int32))
        return kv

    def warmup(self, kv, max_pages: int, *, swap: bool, scrub: bool, swap_pages: bool = True,
               demote_bits: tuple[int, ...] = ()):
        """As `HostSwapSpace.warmup`, plus the window programs (writes to a slot past the end
        are dropped: the state is unchanged). swap_pages=False: windows swap here but pages
        elsewhere (through the tiers), so no page-swap program is compiled."""
        kv = super().warmup(kv, max_pages, swap=swap and swap_pages, scrub=scrub,
                            demote_bits=demote_bits)
        past = jnp.int32(self.allocator.num_seq_slots)
        kv = self._copy_window(kv, jnp.int32(0), past)
        if swap:
            window = [self._to_device((x, x.sharding)) for x in self._window(kv, jnp.int32(0))]
            kv = self._set_window(kv, past, window)
        if scrub:
            for n in powers_of_2_up_to(self.allocator.num_seq_slots):
                kv = self._zero_windows(kv, np.full(n, self.allocator.num_seq_slots, np.int32))
        return kv

    def copy_window(self, kv, src_slot: int, dst_slot: int):
        """A forked child's window (slot dst_slot) starts as a copy of its parent's."""
        return self._copy_window(kv, jnp.int32(src_slot), jnp.int32(dst_slot))
