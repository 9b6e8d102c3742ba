"""Which of a sequence's tokens its pages hold, for a state that keeps its newest tokens in a
window beside the pages (KIVI with an exact window): a token enters the pages once it ages out
of the window, and a sequence's floor is how many leading cache positions are read from its
pages whatever its length (the fully quantized pages it took from the prefix cache or the
tiers). Without a window, pages hold every computed token and every floor is 0."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class WindowFloors:
    """The KV cache manager's per-sequence floors.

    Attributes:
      quantized_len: of a sequence's first n tokens, how many its pages hold; None: no window
        beside the pages (floors are never set).
    """

    def __init__(self, quantized_len: Callable[[int], int] | None):
        self.quantized_len = quantized_len
        self._floors: dict[str, int] = {}  # sequence -> tokens its pages hold from the start

    @property
    def has_window(self) -> bool:
        return self.quantized_len is not None

    def floor(self, seq_id: str) -> int:
        """Cache positions of a sequence read from its pages whatever its length (0 without a
        window)."""
        return self._floors.get(seq_id, 0)

    def paged_len(self, seq_id: str, num_tokens: int) -> int:
        """Of the sequence's first `num_tokens` tokens, how many its pages hold."""
        if self.quantized_len is None:
            return num_tokens
        return max(self.floor(seq_id), int(self.quantized_len(num_tokens)))

    def quantized_lens(self, max_len: int) -> tuple[int, ...] | None:
        """With a window beside the pages: of a sequence's first n tokens, how many its pages
        hold, for n in [0, max_len]; None without one."""
        if self.quantized_len is None:
            return None
        return tuple(int(self.quantized_len(n)) for n in range(max_len + 1))

    def attach_loaded(self, seq_id: str, num_tokens: int) -> None:
        """The sequence's first `num_tokens` came as whole pages from the prefix cache or the
        tiers: with a window beside the pages, they are read from the pages from now on."""
        if self.quantized_len is not None and num_tokens:
            self._floors[seq_id] = max(self.floor(seq_id), num_tokens)

    def paged_tokens(self, seq_id: str, token_ids: Sequence[int]) -> Sequence[int]:
        """The leading `token_ids` whose every token the sequence's pages hold."""
        return token_ids[:self.paged_len(seq_id, len(token_ids))]

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id in self._floors:
            self._floors[child_id] = self._floors[parent_id]

    def saved(self, seq_id: str) -> int | None:
        """The sequence's floor if it has one set, for `restore`."""
        return self._floors.get(seq_id)

    def restore(self, seq_id: str, floor: int | None) -> None:
        """Puts back a floor `saved` returned (None: none set)."""
        if floor is None:
            self._floors.pop(seq_id, None)
        else:
            self._floors[seq_id] = floor

    def pop(self, seq_id: str) -> int:
        """The sequence's floor, forgotten (a compaction rewrites the pages it counted)."""
        return self._floors.pop(seq_id, 0)
