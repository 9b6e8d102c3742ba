"""Sampling parameters (validated on the host) and the jitted sampler.

Randomness is per request: the key for a request's i-th generated token is
`fold_in(key(seed), i)`, so a seeded request samples the same tokens whatever it is batched
with, preempted or recomputed.

Reported logprobs are of the model's own distribution (log-softmax of the logits, before
temperature, top-k and top-p), which is what policy-gradient trainers consume.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _is_int(value) -> bool:
    """An int, numpy's included, but not a bool (True would pass as 1)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
      max_new_tokens: tokens to generate at most (> 0).
      temperature: 0 for greedy; otherwise logits are divided by it.
      top_k: keep the k most likely tokens (0: off).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: off).
      seed: the request's random seed (None: derived from the request id by the engine).
      stop_token_ids: tokens that end the request (kept in the output), besides EOS.
      ignore_eos: keep generating past the model's EOS tokens.
      n: parallel samples of the same prompt (they share the prompt's KV pages).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
                self.stop_token_ids, Sequence | np.ndarray):
            raise ValueError(f"stop_token_ids must be a sequence of int token ids, got "
                             f"{self.stop_token_ids!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be int token ids >= 0, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


def _filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits [B, V] outside each row's top-k / top-p set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [B]
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [B, 1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a sorted token while the mass strictly before it is below top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    keep_sorted = mass_before < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)  # [B]
    pth = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)  # [B, 1]
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, seeds: jax.Array, counters: jax.Array, *,
                  all_greedy: bool, needs_filter: bool) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row.

    Args:
      logits: [B, V] float32.
      temperature, top_p: [B] float32; top_k: [B] int32.
      seeds: [B] uint32; counters: [B] int32 (index of the token being generated).
      all_greedy, needs_filter: static switches that skip unused work.
    Returns:
      tokens [B] int32 and their logprobs [B] float32 under the unmodified distribution.
    """
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy
    else:
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        if needs_filter:
            scaled = _filter_logits(scaled, top_k, top_p)

        def draw(seed, counter, row):
            key = jax.random.fold_in(jax.random.key(seed), counter)
            return jax.random.categorical(key, row).astype(jnp.int32)

        sampled = jax.vmap(draw)(seeds, counters, scaled)
        tokens = jnp.where(temperature > 0, sampled, greedy)
    logprobs = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


def verify_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  seeds: jax.Array, counters: jax.Array, *, all_greedy: bool,
                  needs_filter: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative verification of deterministic drafts, one row per sequence.

    Row b scored its last token and its drafts: logits[b, j] is the model's distribution of
    the token after drafts[b, :j]. Greedy rows keep the drafts while each equals the argmax;
    sampled rows keep draft j with probability p_j(d_j) (p: the tempered, filtered
    distribution) and, at the first rejection, sample from p_j with d_j removed, which is
    exactly p_j: the output distribution is the model's. After the last kept draft the row
    emits one more token of its own (at j == num_drafts, an ordinary sample; a row without
    drafts samples exactly as `sample_tokens` does).

    Args:
      logits: [B, W, V] float32 (W = 1 + the most drafts).
      drafts: [B, W - 1] int32; num_drafts: [B] int32 (<= W - 1).
      temperature, top_k, top_p, seeds, counters: per row as in `sample_tokens`; position j
        of row b draws with counter counters[b] + j.
    Returns:
      num_accepted [B] int32, the token emitted after them [B] int32, and the logprobs
      (unmodified distribution) of the emitted tokens [B, W]: drafts first, then that token.
    """
    b, w, vocab = logits.shape
    j = jnp.arange(w, dtype=jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, W]
    has_draft = j[None, :] < num_drafts[:, None]  # [B, W]
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, W]
    if all_greedy:
        accept, final = padded == target, target
    else:
        flat = logits.reshape(b * w, vocab)
        rep = functools.partial(jnp.repeat, repeats=w, axis=0)
        scaled = flat / rep(jnp.where(temperature > 0, temperature, 1.0))[:, None]
        if needs_filter:
            scaled = _filter_logits(scaled, rep(top_k), rep(top_p))
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
            rep(seeds), (counters[:, None] + j[None, :]).reshape(-1))
        d = padded.reshape(-1)
        p_draft = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1), d[:, None], axis=-1)[:, 0]
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        without = scaled.at[jnp.arange(b * w), d].set(-jnp.inf)
        residual = jax.vmap(lambda k, row: jax.random.categorical(jax.random.fold_in(k, 2), row)
                            )(keys, without).astype(jnp.int32)
        plain = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        is_sampled = (temperature > 0)[:, None]
        accept = jnp.where(is_sampled, (u < p_draft).reshape(b, w), padded == target)
        final = jnp.where(is_sampled, jnp.where(has_draft, residual.reshape(b, w),
                                                 plain.reshape(b, w)), target)
    num_accepted = jnp.sum(jnp.cumprod(accept & has_draft, axis=1), axis=1).astype(jnp.int32)
    token = jnp.take_along_axis(final, num_accepted[:, None], axis=1)[:, 0]
    emitted = jnp.where(j[None, :] < num_accepted[:, None], padded,
                        jnp.where(j[None, :] == num_accepted[:, None], token[:, None], 0))
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), emitted[..., None],
                                   axis=-1)[..., 0]
    return num_accepted, token, logprobs
