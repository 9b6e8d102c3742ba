"""Host-authoritative sparse KV (ECHO): the KV cache manager's page moves for it.

Under Quest's `echo_prefetch` option every full page of a decoding sequence gets a copy in the
host pool (`echo_mirror`), and the device keeps, per layer, only the pages that layer is likely
to select (`kvjax.scheduler.echo` plans which). Device pages hold them as frames: a frame is a
fresh private page at one of the sequence's released block-table entries (`echo_frames`), never
indexed by the prefix cache and never shared, so its layer l may hold another entry's layer l
(`echo_fill`, one `KVOpKind.HOST_IN` op of single layers). A page the sequence computed itself
is read-only here where the prefix cache may index it or a fork share it: it stays resident,
for its own entry in every layer, until `echo_release` gives it back; one the sequence alone
holds, with no prefix cache, may become a frame in place (`echo_adoptable`).

A base of `kvjax.memory.host_moves.HostMoves`: plain Python and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.memory.block_manager import RELEASED
from kvjax.memory.ops import KVOp, KVOpKind
from kvjax.shapes import pad_repeat_last


def _padded(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(pad_repeat_last(list(values)).tolist())


class EchoPages:
    """ECHO's page moves (see the module docstring); stats `echo_pages_mirrored`,
    `echo_pages_released`, `echo_frames_taken`, `echo_layer_pages_prefetched`."""

    def echo_host_table(self, seq_id: str) -> np.ndarray:
        """[n] int32 over a host-authoritative sequence's block-table entries: the entry's
        host copy, or -1 where it has none (its device page is all there is)."""
        host = self.host_table(seq_id)
        return np.asarray([host[i] if i < len(host) else -1
                           for i in range(len(self.allocator.block_table(seq_id)))], np.int32)

    def echo_mirror(self, seq_id: str, num_full: int) -> int:
        """Copies the sequence's full pages [0, num_full) that have no host copy yet to the
        host pool (as many as it has room for; the device keeps them); returns how many
        leading pages have a copy."""
        held = self.host_pool.num_held(seq_id)
        table = self.allocator.block_table(seq_id)
        new = min(num_full - held, self.host_pool.num_free())
        if new > 0:
            src = table[held:held + new]
            dst = self.host_pool.take(seq_id, new)
            self.versions.to_host(src, dst)
            self.ops.issue(KVOp(KVOpKind.HOST_OUT, tuple(src), src=_padded(src), dst=_padded(dst)))
            self.stats["echo_pages_mirrored"] += new
            held += new
        return held

    def echo_adoptable(self, seq_id: str, entries: Sequence[int]) -> list[int]:
        """Of the given entries, those whose device page this sequence alone holds and no prefix
        cache indexes: such a page may become a frame where it is."""
        if self.allocator.prefix_cache is not None:
            return []
        table = self.allocator.block_table(seq_id)
        return [j for j in entries if self.allocator.ref_count(table[j]) == 1]

    def echo_release(self, seq_id: str, entries: Sequence[int]) -> None:
        """Gives back the device pages of entries with a host copy (pages or frames)."""
        freed = []
        for index in entries:
            freed += self.allocator.release_pages(seq_id, index, 1)[1]
        self.stats["echo_pages_released"] += len(entries)
        if self.scrub_freed_pages and freed:
            self._spill()
            self._scrub(freed)

    def echo_frames(self, seq_id: str, entries: Sequence[int]) -> list[int]:
        """Fresh private device pages (frames) at released entries, in order, while the device
        pool has room; returns the entries that got one."""
        got = []
        host = self.host_pool.table(seq_id)
        for index in entries:
            page = self.allocator.fill_pages(seq_id, index, 1)
            if page is None:
                break
            self.versions.to_device([host[index]], page)
            got.append(index)
        if got:
            self._spill()  # Before a fill overwrites pages evicted for them.
            self.stats["echo_frames_taken"] += len(got)
        return got

    def echo_fill(self, seq_id: str, fills: Sequence[tuple[int, int, int]]) -> None:
        """For each (layer, j, k): that layer of the frame at entry k becomes a copy of that
        layer of entry j's host copy."""
        if not fills:
            return
        host = self.host_pool.table(seq_id)
        table = self.allocator.block_table(seq_id)
        if any(table[k] == RELEASED for _, _, k in fills):
            raise ValueError(f"sequence {seq_id!r}: a fill targets an entry without a frame")
        layers, src, dst = zip(*[(layer, host[j], table[k]) for layer, j, k in fills],
                               strict=True)
        self.ops.issue(KVOp(KVOpKind.HOST_IN, tuple(sorted(set(dst))), src=_padded(src),
                         dst=_padded(dst), layers=_padded(layers)))
        self.stats["echo_layer_pages_prefetched"] += len(fills)
