"""Speculative decoding: where draft tokens come from, and how many a sequence verifies at once.

A decoding sequence proposes up to gamma tokens; one verify step scores them all against the
KV in a single multi-token row, keeps the longest prefix the model agrees with plus the
model's own next token (`kvjax.sampling.verify_drafts`), and the scheduler rolls the rejected
tokens' KV slots back. The output is the model's: token-identical to plain decoding with greedy
sampling, and the same distribution with temperature.

A `Drafter` is a small policy registered by name (`EngineConfig.spec.method`):

  * `none`: no drafts (plain decoding);
  * `ngram` (prompt lookup): the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens, longest n first; host only, no draft steps;
  * `sparse_self` (MagicDec's self-speculation): the model itself proposes, in gamma draft
    decode steps that read only a StreamingLLM subset of the sequence's own pages (the first
    `num_sinks` tokens' pages and the pages of the last `window` tokens). The draft writes its
    K/V into the sequence's own slots, which the verify step overwrites: no second copy of KV.

Retention and KIVI. A verify row must read, for each of its tokens, what that token's own decode
step would. An evicting retention policy may decide after any step (streaming, h2o and tova once
a sequence caches B + P tokens; the prefill presses while their one compression is pending), and
KIVI ages a key group into codes once newer tokens push it out of the exact window: either inside
a row would leave its later queries reading another cache than plain decoding's. So a row is cut
(`KVCacheManager.max_verify_tokens`) to end at the first token after which the policy may
decide, and to age no key group (a row that must age one verifies no drafts). After the step
the policy observes the kept tokens one at a time, each with the key scores its query gave
alone (`StepOutput.query_key_scores`, the scores its decode step would have), and decides once,
after the last: plain decoding's decisions after the earlier ones keep everything. Rejected
drafts never reach the policy and never enter an aged group; under KIVI the sparse draft reads
every page (KIVI addresses its exact window and key groups by cache position). Greedy tokens
and logprobs are plain decoding's; the price is a shorter row (retention) or one without
drafts (KIVI), at most once per P or g tokens. Quest stays refused (`kvjax.engine.compat`): it
picks pages per query, from per-page key bounds that a rejected draft's key would widen for good.

Drafts are deterministic (the draft's argmax), so verification with temperature uses the
point-mass form of speculative sampling: a draft d is kept with probability p(d), and a
rejection samples from p with d removed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (`EngineConfig.spec`).

    Attributes:
      method: a drafter registered in `DRAFTERS` ('none', 'ngram', 'sparse_self').
      num_draft_tokens: gamma, the most tokens a sequence proposes per verify step (> 0).
      options: keyword options of the drafter (ngram: max_ngram, min_ngram; sparse_self:
        num_sinks and window, in tokens: the draft budget).
      adaptive: each sequence drafts as many tokens as its last verify step kept plus one
        (all gamma kept: one more, up to gamma), so a sequence whose drafts fail stops paying
        for long drafts; False: always gamma.
    """

    method: str = "none"
    num_draft_tokens: int = 4
    options: dict = dataclasses.field(default_factory=dict)
    adaptive: bool = False

    def __post_init__(self):
        if self.method not in DRAFTERS:
            raise ValueError(f"spec.method must be one of {sorted(DRAFTERS)}, got "
                             f"{self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens <= 0:
            raise ValueError(f"spec.num_draft_tokens must be a positive int, got "
                             f"{self.num_draft_tokens!r}")
        make_drafter(self.method, **self.options)  # Raises on bad options.

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class Drafter(Protocol):
    """Proposes draft tokens for a decoding sequence.

    A drafter either proposes on the host (`propose`) or has the model draft in draft steps
    (`runs_draft_steps`), each reading the pages `draft_reads` chooses.
    """

    name: str
    runs_draft_steps: bool

    def propose(self, tokens: Sequence[int], num: int) -> list[int]:
        """Up to `num` draft tokens to follow `tokens` (host drafters; [] for the others)."""

    def draft_reads(self, block_table: np.ndarray, kv_len: int, page_size: int
                    ) -> tuple[np.ndarray, int]:
        """(pages, length) a draft step reads: a subset of `block_table` whose first `length`
        slots, concatenated, are the tokens the draft attends to (the last one included)."""


class NoDrafts:
    name = "none"
    runs_draft_steps = False

    def propose(self, tokens: Sequence[int], num: int) -> list[int]:
        return []

    def draft_reads(self, block_table: np.ndarray, kv_len: int, page_size: int
                    ) -> tuple[np.ndarray, int]:
        return block_table, kv_len


class NgramDrafter(NoDrafts):
    """Prompt lookup: continue the most recent earlier match of the last n tokens."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram drafts need 1 <= min_ngram <= max_ngram, got "
                             f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: Sequence[int], num: int) -> list[int]:
        seq = np.asarray(tokens, np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            # Windows that start before the suffix itself and have a token after them.
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start:start + num].tolist()
        return []


class SparseSelfDrafter(NoDrafts):
    """The model drafts over attention sinks and a recent window of its own pages."""

    name = "sparse_self"
    runs_draft_steps = True

    def __init__(self, num_sinks: int = 16, window: int = 256):
        if num_sinks < 0 or window <= 0:
            raise ValueError(f"sparse_self drafts need num_sinks >= 0 and window > 0, got "
                             f"num_sinks={num_sinks!r}, window={window!r}")
        self.num_sinks, self.window = num_sinks, window

    def draft_reads(self, block_table: np.ndarray, kv_len: int, page_size: int
                    ) -> tuple[np.ndarray, int]:
        last = (kv_len - 1) // page_size  # the page the draft token is written into
        sinks = -(-self.num_sinks // page_size)
        first = max(kv_len - self.window, 0) // page_size  # the window's first page
        if first <= sinks:
            return block_table, kv_len
        pages = np.concatenate([block_table[:sinks], block_table[first:last + 1]])
        return pages, (sinks + last - first) * page_size + (kv_len - 1) % page_size + 1


DRAFTERS = Registry("draft method", {
    "none": NoDrafts, "ngram": NgramDrafter, "sparse_self": SparseSelfDrafter})


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    DRAFTERS.register(name, factory)


def make_drafter(name: str, **options) -> Drafter:
    return DRAFTERS.make(name, **options)
