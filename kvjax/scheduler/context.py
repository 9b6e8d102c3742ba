"""Non-prefix context reuse: the KV of a chunk (a retrieved document) computed once, reused at
any position of any prompt, with a correction chosen by strategy.

A prompt is given as segments (`Segment`); a reusable one is a chunk. The chunk cache keeps a
chunk's KV as if the chunk were a prompt of its own (positions 0..L-1, no context before it):
its tokens, padded to whole pages, are a prefix-cache entry under the request's cache key plus a
chunk marker, so chunk pages live in the same pool and tiers as prefix pages, are
reference-counted and evicted under the same pressure, and are isolated by tenant salt and
provenance exactly like them. A missing chunk is computed first by a fill sequence (a prefill
of the chunk alone, whose pages stay cached).

When a request's prefill reaches a chunk at position a, the chunk's cached tokens are copied
into the request's own pages with their keys re-rotated by a (RoPE is a rotation, so the
position part is exact; `kvjax.kv.reuse`); the shared chunk pages are never written. What the
copy misses is the attention to the context before the chunk, which each `ReuseStrategy`
corrects in its own way:

  * `full`: recompute everything (segments ignored): the exact baseline.
  * `none`: plain concatenation of the cached chunks.
  * `ape` (APE, ICLR'25): every chunk is encoded after the same shared prefix (the prompt's
    tokens before its first chunk, so chunks see the system prompt and its attention sink),
    and a temperature scales the attention later tokens pay to the chunk (its cached keys
    are multiplied by 1 / temperature when copied). APE's third part, a scale factor on the
    chunks' share of attention, needs a per-key logit bias the attention kernels do not
    take; it is not implemented.
  * `epic` (EPIC's LegoLink): the first `num_tokens` tokens of each chunk are recomputed with
    the full context (they absorb the chunk's attention sink); the rest is copied.
  * `cacheblend` (CacheBlend, EuroSys'25): after the copy, the chunk's tokens are run through
    the first layer with the full context; the `ratio` fraction whose second-layer K/V deviate
    most from the copy are recomputed in every layer (`kvjax.engine.step.blend_step`).

The KV a request holds after a reused chunk depends on the strategy, so its own pages are
cached under a cache key that names the strategy and the chunk spans: a later request shares
them only when it reuses the same chunks the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of a prompt: token ids, and whether its KV may come from the chunk cache."""

    ids: tuple[int, ...]
    reuse: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ids", tuple(int(t) for t in np.asarray(self.ids).ravel()))


def split_segments(segments: Sequence[Segment]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt of `segments` and the [start, end) spans of its reusable ones."""
    prompt, spans = [], []
    for seg in segments:
        if seg.reuse and seg.ids:
            spans.append((len(prompt), len(prompt) + len(seg.ids)))
        prompt.extend(seg.ids)
    return prompt, spans


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How one reused chunk of L tokens enters a request.

    Attributes:
      recompute_first: its first tokens computed by the request's prefill, with the context
        (the rest is copied from the chunk cache).
      key_scale: factor on the copied keys (1: none).
      blend_ratio: the fraction of the copied tokens recomputed by deviation after the copy
        (`blend_count`); 0: none.
      shared_prefix: the chunk is encoded after the prompt's tokens before its first chunk
        (the system prompt), as APE encodes every context after one shared prefix; False:
        alone.
    """

    recompute_first: int = 0
    key_scale: float = 1.0
    blend_ratio: float = 0.0
    shared_prefix: bool = False


class ReuseStrategy(Protocol):
    """A correction for chunks computed without their context (registered by name)."""

    name: str
    reuses: bool  # False: chunks are recomputed like any prompt tokens ('full')

    def plan(self, chunk_len: int) -> ChunkPlan:
        """How a chunk of `chunk_len` tokens enters a request."""

    @property
    def fingerprint(self) -> str:
        """The strategy and its options: part of the cache key of a request's own pages."""


@dataclasses.dataclass(frozen=True)
class Full:
    name: ClassVar[str] = "full"
    reuses: ClassVar[bool] = False

    def plan(self, chunk_len: int) -> ChunkPlan:
        return ChunkPlan(recompute_first=chunk_len)

    @property
    def fingerprint(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Concatenate:
    name: ClassVar[str] = "none"
    reuses: ClassVar[bool] = True

    def plan(self, chunk_len: int) -> ChunkPlan:
        return ChunkPlan()

    @property
    def fingerprint(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class APE:
    """Chunks encoded after the shared prefix (the prompt before the first chunk), and an
    attention temperature on them (temperature < 1 sharpens, > 1 flattens)."""

    temperature: float = 0.9
    shared_prefix: bool = True
    name: ClassVar[str] = "ape"
    reuses: ClassVar[bool] = True

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"ape temperature must be > 0, got {self.temperature!r}")

    def plan(self, chunk_len: int) -> ChunkPlan:
        return ChunkPlan(key_scale=1.0 / self.temperature, shared_prefix=self.shared_prefix)

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:t={self.temperature}:prefix={self.shared_prefix}"


@dataclasses.dataclass(frozen=True)
class EPIC:
    """Recompute the first `num_tokens` tokens of every chunk."""

    num_tokens: int = 16
    name: ClassVar[str] = "epic"
    reuses: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"epic num_tokens must be an int >= 0, got {self.num_tokens!r}")

    def plan(self, chunk_len: int) -> ChunkPlan:
        return ChunkPlan(recompute_first=min(self.num_tokens, chunk_len))

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:k={self.num_tokens}"


@dataclasses.dataclass(frozen=True)
class CacheBlend:
    """Recompute the `ratio` fraction of each chunk's tokens whose KV deviates most."""

    ratio: float = 0.15
    name: ClassVar[str] = "cacheblend"
    reuses: ClassVar[bool] = True

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"cacheblend ratio must be in (0, 1], got {self.ratio!r}")

    def plan(self, chunk_len: int) -> ChunkPlan:
        return ChunkPlan(blend_ratio=self.ratio)

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:r={self.ratio}"


def blend_count(ratio: float, num_tokens: int) -> int:
    """Tokens CacheBlend recomputes of `num_tokens` (at least one)."""
    return max(1, min(num_tokens, math.ceil(ratio * num_tokens)))


STRATEGIES: dict[str, Callable[..., ReuseStrategy]] = {
    "full": Full, "none": Concatenate, "ape": APE, "epic": EPIC, "cacheblend": CacheBlend}


def register_strategy(name: str, factory: Callable[..., ReuseStrategy]) -> None:
    """Makes a strategy available by name (EngineConfig.context_reuse, per request)."""
    if name in STRATEGIES:
        raise ValueError(f"context reuse strategy {name!r} is already registered")
    STRATEGIES[name] = factory


def make_strategy(name: str, **options) -> ReuseStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"context_reuse must be one of {sorted(STRATEGIES)}, got {name!r}")
    try:
        return STRATEGIES[name](**options)
    except TypeError as e:
        raise ValueError(f"context reuse strategy {name!r}: bad options {options!r} ({e})"
                         ) from None


def clip_spans(spans: Sequence[tuple[int, int]], num_tokens: int) -> list[tuple[int, int]]:
    """Spans inside a sequence of `num_tokens` tokens whose last token is always computed
    (its logits sample the first output token)."""
    out = []
    for start, end in spans:
        end = min(end, num_tokens - 1)
        if end > start:
            out.append((int(start), int(end)))
    return out
