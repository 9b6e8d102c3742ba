"""The jitted sampler, and the sampling parameters it reads (`kvjax.sampling_params`).

Randomness is per request: the key for a request's i-th generated token is
`fold_in(key(seed), i)`, so a seeded request samples the same tokens whatever it is batched
with, preempted or recomputed.

Logits pass through the rules in vLLM's order:

  1. logit bias, and EOS / stop tokens masked while fewer than `min_tokens` are generated;
  2. penalties on the biased raw logits: repetition (tokens of the prompt and the output,
     positive logits divided by it, negative ones multiplied), then frequency (minus
     frequency_penalty times the token's count in the output) and presence (minus
     presence_penalty once per token present in the output);
  3. temperature (greedy rows take the argmax here);
  4. min-p, then top-k, then top-p over what top-k kept (renormalized).

A row with a grammar (`kvjax.grammar`) masks the tokens its grammar forbids to -inf after
step 2 (`apply_token_mask`): its greedy pick and its sample are among the allowed tokens.

Every rule reads per-row arrays inside one jitted program, so requests with other values
compile nothing new; only the switches `all_greedy`, `needs_filter` and whether rules are on
at all (`LogitRules` or None) are static.

Reported logprobs are of the model's own distribution (log-softmax of the raw logits, before
every rule above), which is what policy-gradient trainers consume.

Every sum over a row's vocabulary (log-softmax, top-p's softmax and its running mass) goes
through `RowSums`: XLA's reductions by default, or ones in an order fixed by the vocabulary
size alone (`kvjax.models.invariant.ROW_SUMS`, batch-invariant mode), so a row's filtered set
and its draw do not depend on the rows beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

# Defined without jax in kvjax.sampling_params; importable from here as before.
from kvjax.sampling_params import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS
from kvjax.sampling_params import SamplingParams as SamplingParams


@struct.dataclass
class LogitRules:
    """Per-row inputs of the rules applied to raw logits before temperature (N rows).

    Attributes:
      prompt_mask: [N, V] bool, tokens the row's prompt holds.
      output_counts: [N, V] int32, each token's occurrences in the row's output so far.
      presence, frequency, repetition: [N] float32 penalties (0, 0, 1: off).
      bias_ids: [N, K] int32, bias_values: [N, K] float32 (-inf masks),
      bias_until: [N, K] int32: entry k adds bias_values[k] to token bias_ids[k] while the
        row's counter (tokens generated before this one) is below bias_until[k]; padding
        entries add 0.
    """

    prompt_mask: jax.Array
    output_counts: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    bias_until: jax.Array


def apply_rules(logits: jax.Array, rules: LogitRules, counters: jax.Array) -> jax.Array:
    """Logit bias and min_tokens masks, then the repetition, frequency and presence
    penalties. logits: [N, V] float32; counters: [N] int32 -> [N, V] float32."""
    rows = jnp.arange(logits.shape[0])[:, None]  # [N, 1]
    active = counters[:, None] < rules.bias_until  # [N, K]
    logits = logits.at[rows, rules.bias_ids].add(jnp.where(active, rules.bias_values, 0.0))
    seen = rules.output_counts > 0  # [N, V]
    repeat = rules.repetition[:, None]
    penalized = jnp.where(logits > 0, logits / repeat, logits * repeat)
    logits = jnp.where(rules.prompt_mask | seen, penalized, logits)
    logits = logits - rules.frequency[:, None] * rules.output_counts
    return logits - rules.presence[:, None] * seen


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Sets the logits of tokens a row's bitmask forbids to -inf. logits: [N, V] float32;
    token_mask: [N, ceil(V / 32)] int32, bit t % 32 of word t // 32 set when token t is
    allowed (-1: every token) -> [N, V]."""
    n, vocab = logits.shape
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    allowed = (token_mask[:, :, None] >> bits) & 1  # [N, W, 32]
    allowed = allowed.reshape(n, -1)[:, :vocab]  # [N, V]
    return jnp.where(allowed > 0, logits, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class RowSums:
    """The sums over each row of [B, V] the sampler takes.

    Attributes:
      row_sum: [B, V] -> [B, 1], each row's sum.
      cumsum: [B, V] -> [B, V], each row's inclusive running sum.
    """

    row_sum: Callable[[jax.Array], jax.Array]
    cumsum: Callable[[jax.Array], jax.Array]

    def softmax(self, logits: jax.Array) -> jax.Array:
        """[B, V] -> [B, V]."""
        exp = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
        return exp / self.row_sum(exp)

    def log_softmax(self, logits: jax.Array) -> jax.Array:
        """[B, V] -> [B, V]."""
        shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        return shifted - jnp.log(self.row_sum(jnp.exp(shifted)))


def _filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array, row_sums: RowSums | None = None) -> jax.Array:
    """Masks tempered logits [B, V] outside each row's min-p, then top-k, then top-p set
    (top-p over the top-k set renormalized) to -inf; ties with the last kept token stay.
    `row_sums`: how top-p sums (None: XLA's softmax and cumsum)."""
    vocab = logits.shape[-1]
    # min-p: p >= min_p * p_max, in logits (log 0 = -inf keeps every token).
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # [B, 1]
    logits = jnp.where(logits >= floor, logits, -jnp.inf)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [B]
    sorted_logits = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_logits, -jnp.inf)
    if row_sums is None:
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass = jnp.cumsum(probs, axis=-1)  # [B, V]
    else:
        probs = row_sums.softmax(sorted_logits)
        mass = row_sums.cumsum(probs)  # [B, V]
    # Keep a sorted token while the mass strictly before it is below top_p (top_p = 1 keeps
    # all: rounding must not drop the tail).
    mass_before = mass - probs  # [B, V]
    keep_sorted = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (
        sorted_logits > -jnp.inf)
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)  # [B]
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _filter_if_any(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, min_p: jax.Array, row_sums: RowSums | None = None
                   ) -> jax.Array:
    """`_filter_logits` when a sampled row filters, else the logits as they are: the step
    variant with rules is compiled filtered, and its sort over the vocabulary must not slow
    the steps whose rows only penalize. All rows [B]."""
    active = (temperature > 0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))  # [B]
    return jax.lax.cond(jnp.any(active),
                        lambda x: _filter_logits(x, top_k, top_p, min_p, row_sums),
                        lambda x: x, logits)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, seeds: jax.Array, counters: jax.Array,
                  min_p: jax.Array | None = None, rules: LogitRules | None = None,
                  token_mask: jax.Array | None = None, *,
                  all_greedy: bool, needs_filter: bool, row_sums: RowSums | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row.

    Args:
      logits: [B, V] float32.
      temperature, top_p, min_p: [B] float32 (min_p None: 0); top_k: [B] int32.
      seeds: [B] uint32; counters: [B] int32 (index of the token being generated).
      rules: the rows' penalties and biases (`apply_rules`), or None: none.
      token_mask: [B, ceil(V / 32)] int32, the tokens each row may pick (`apply_token_mask`;
        -1 words: all), or None: all.
      all_greedy, needs_filter: static switches that skip unused work.
      row_sums: the sums of the logprobs' log-softmax and of top-p (None: XLA's; fixed-order
        ones, `kvjax.models.invariant.ROW_SUMS`, make each row's result batch-invariant).
    Returns:
      tokens [B] int32 and their logprobs [B] float32 under the unmodified distribution.
    """
    logprobs_all = (jax.nn.log_softmax(logits, axis=-1) if row_sums is None
                    else row_sums.log_softmax(logits))  # [B, V]
    processed = logits if rules is None else apply_rules(logits, rules, counters)
    if token_mask is not None:
        processed = apply_token_mask(processed, token_mask)
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy
    else:
        def sample(logits: jax.Array) -> jax.Array:
            scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
            if needs_filter:
                scaled = _filter_if_any(scaled, temperature, top_k, top_p,
                                        _or_zeros(min_p, temperature), row_sums)

            def draw(seed, counter, row):
                key = jax.random.fold_in(jax.random.key(seed), counter)
                return jax.random.categorical(key, row).astype(jnp.int32)

            sampled = jax.vmap(draw)(seeds, counters, scaled)
            return jnp.where(temperature > 0, sampled, greedy)

        # A step of greedy rows only (the variant with rules serves them too) draws nothing.
        tokens = jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, processed)
    logprobs = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


def _or_zeros(min_p: jax.Array | None, like: jax.Array) -> jax.Array:
    return jnp.zeros_like(like) if min_p is None else min_p


def draft_rules(rules: LogitRules, drafts: jax.Array, num_drafts: jax.Array) -> LogitRules:
    """The rules of each verify position, [B] rows -> [B * W] rows (W = 1 + drafts' width):
    position j of row b counts drafts[b, :j] as output besides what the row's rules count.
    drafts: [B, W - 1] int32; num_drafts: [B] int32."""
    b, w1 = drafts.shape
    vocab = rules.output_counts.shape[-1]
    real = jnp.arange(w1)[None, :] < num_drafts[:, None]  # [B, W-1]
    onehot = jax.nn.one_hot(drafts, vocab, dtype=jnp.int32) * real[..., None]  # [B, W-1, V]
    before = jnp.concatenate([jnp.zeros((b, 1, vocab), jnp.int32),
                              jnp.cumsum(onehot, axis=1)], axis=1)  # [B, W, V]
    counts = (rules.output_counts[:, None] + before).reshape(b * (w1 + 1), vocab)
    rep = functools.partial(jnp.repeat, repeats=w1 + 1, axis=0)
    return jax.tree.map(rep, rules).replace(output_counts=counts)


def verify_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  seeds: jax.Array, counters: jax.Array, min_p: jax.Array | None = None,
                  rules: LogitRules | None = None, token_mask: jax.Array | None = None, *,
                  all_greedy: bool, needs_filter: bool, draft_mask: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative verification of deterministic drafts, one row per sequence.

    Row b scored its last token and its drafts: logits[b, j] is the model's distribution of
    the token after drafts[b, :j]. Greedy rows keep the drafts while each equals the argmax;
    sampled rows keep draft j with probability p_j(d_j) (p: the tempered, filtered
    distribution) and, at the first rejection, sample from p_j with d_j removed, which is
    exactly p_j: the output distribution is the model's. After the last kept draft the row
    emits one more token of its own (at j == num_drafts, an ordinary sample; a row without
    drafts samples exactly as `sample_tokens` does). With `rules`, position j applies them
    with drafts[b, :j] counted as output (`draft_rules`) and counter counters[b] + j, so the
    output equals one token at a time under the same rules.

    Args:
      logits: [B, W, V] float32 (W = 1 + the most drafts).
      drafts: [B, W - 1] int32; num_drafts: [B] int32 (<= W - 1).
      temperature, top_k, top_p, min_p, seeds, counters: per row as in `sample_tokens`;
        position j of row b draws with counter counters[b] + j.
      rules: per row as in `sample_tokens`, counting the output up to the row's last token.
      token_mask: [B, ceil(V / 32)] int32 or None: the tokens a row may emit at position 0.
      draft_mask: [B, W - 1, ceil(V / 32)] int32 or None: those it may emit after each draft
        (a grammar's mask after drafts[b, :j + 1]); None: token_mask at every position. A
        draft the mask forbids is rejected, so the output follows the grammar exactly.
    Returns:
      num_accepted [B] int32, the token emitted after them [B] int32, and the logprobs
      (unmodified distribution) of the emitted tokens [B, W]: drafts first, then that token.
    """
    b, w, vocab = logits.shape
    j = jnp.arange(w, dtype=jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, W]
    has_draft = j[None, :] < num_drafts[:, None]  # [B, W]
    flat_counters = (counters[:, None] + j[None, :]).reshape(-1)  # [B*W]
    flat = logits.reshape(b * w, vocab)
    if rules is not None:
        flat = apply_rules(flat, draft_rules(rules, drafts, num_drafts), flat_counters)
    if token_mask is not None:
        per_position = (jnp.repeat(token_mask[:, None], w, axis=1) if draft_mask is None
                        else jnp.concatenate([token_mask[:, None], draft_mask], axis=1))
        flat = apply_token_mask(flat, per_position.reshape(b * w, -1))
    target = jnp.argmax(flat, axis=-1).astype(jnp.int32).reshape(b, w)  # [B, W]
    if all_greedy:
        accept, final = padded == target, target
    else:
        rep = functools.partial(jnp.repeat, repeats=w, axis=0)
        scaled = flat / rep(jnp.where(temperature > 0, temperature, 1.0))[:, None]
        if needs_filter:
            scaled = _filter_if_any(scaled, rep(temperature), rep(top_k), rep(top_p),
                                    rep(_or_zeros(min_p, temperature)))
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
            rep(seeds), flat_counters)
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
