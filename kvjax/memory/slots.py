"""The contiguous baseline's allocator: one fixed slot of max_len tokens per sequence.

It speaks the block manager's interface so the engine drives both layouts the same way; its
block tables are the fixed page ranges of a slot (see `kvjax.kv.state.ContiguousKV`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvjax.memory.block_manager import AllocStatus, CopyOp
from kvjax.trace import NULL_TRACER, Tracer


class SlotAllocator:
    """Hands out whole sequence slots; a sequence can never outgrow its slot's max_len."""

    def __init__(self, max_seqs: int, max_len: int, page_size: int):
        self.num_slots = max_seqs
        self.tracer: Tracer = NULL_TRACER  # slots have no page lifecycle to report
        self.max_len = max_len
        self.page_size = page_size
        self.pages_per_seq = max_len // page_size
        self.num_pages = max_seqs * self.pages_per_seq
        self._free = list(range(max_seqs - 1, -1, -1))
        self._slot_of: dict[Hashable, int] = {}
        self.prefix_cache = None  # Slots are never shared.

    @property
    def capacity(self) -> int:
        return self.num_pages

    def num_free_pages(self) -> int:
        return len(self._free) * self.pages_per_seq

    def num_used_pages(self) -> int:
        return len(self._slot_of) * self.pages_per_seq

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot_of

    def seq_slot(self, seq_id: Hashable) -> int:
        """No per-sequence state slot beside the KV slots: 0."""
        return 0

    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        return 0 if seq_id in self._slot_of else self.pages_per_seq

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], *,
                     cache_key: bytes = b"", indexable: bool = True,
                     record_stats: bool = True, max_hit: int | None = None) -> int:
        if seq_id in self._slot_of:
            raise ValueError(f"sequence {seq_id!r} is already registered")
        self._slot_of[seq_id] = -1  # A slot is taken on the first write.
        return 0

    def ensure_writable(self, seq_id: Hashable, start: int, end: int
                        ) -> tuple[AllocStatus, list[CopyOp]]:
        if end > self.max_len:
            raise ValueError(f"position {end} is past the slot length {self.max_len}")
        if self._slot_of[seq_id] < 0:
            if not self._free:
                return AllocStatus.NO_PAGES, []
            self._slot_of[seq_id] = self._free.pop()
        return AllocStatus.OK, []

    def ensure_restored(self, seq_id: Hashable, start: int, end: int
                        ) -> tuple[AllocStatus, list[CopyOp]]:
        """A returning sequence's slot (`ensure_writable`: a slot holds every position)."""
        return self.ensure_writable(seq_id, start, end)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[CopyOp]:
        """Gives the child its own slot holding a copy of the parent's pages."""
        if not self._free:
            raise ValueError("no free slot to fork into")
        child = self._free.pop()
        self._slot_of[child_id] = child
        parent = self._slot_of[parent_id]
        return [CopyOp(src=parent * self.pages_per_seq + j, dst=child * self.pages_per_seq + j)
                for j in range(self.pages_per_seq)]

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        pass

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """A slot keeps its pages whatever the sequence's length: nothing to release."""
        return []

    def free(self, seq_id: Hashable) -> list[int]:
        slot = self._slot_of.pop(seq_id)
        if slot < 0:
            return []
        self._free.append(slot)
        return list(range(slot * self.pages_per_seq, (slot + 1) * self.pages_per_seq))

    def take_released(self) -> list[int]:
        """Pages windows gave back since the last call: none (slots keep every token)."""
        return []

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Every layer group's table: the slot's one."""
        return [self.block_table(seq_id)]

    def block_table_array(self, seq_id: Hashable) -> np.ndarray:
        """[1, pages_per_seq] int32: `block_tables` as one array."""
        return np.asarray(self.block_tables(seq_id), np.int32)

    def block_table(self, seq_id: Hashable) -> list[int]:
        slot = self._slot_of[seq_id]
        return list(range(slot * self.pages_per_seq, (slot + 1) * self.pages_per_seq))
