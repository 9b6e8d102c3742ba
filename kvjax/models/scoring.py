"""Prefill-only scoring, layer by layer (PrefillOnly): only one layer's KV is ever held.

A normal prefill keeps every layer's K/V for the whole input ([L, S, K, D]) because decode
reads it later. Scoring needs no decode, so `layerwise_hidden` runs layer 0 over the whole
input in chunks, keeping only layer 0's K/V ([S, K, D]) while it does, then layer 1 over the
hidden states layer 0 produced, and so on: peak KV is one layer's, and inputs about L times
longer than an all-layer KV budget fit. Shapes are bucketed to powers of two (>= the chunk),
plus one bucket at the budget's limit, so the compile count stays flat.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.jit import Program
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.shapes import next_power_of_2


@functools.partial(Program, static_argnames=("config", "chunk"), donate_argnames=("h",))
def _layer_pass(config: ModelConfig, chunk: int, layers, layer: jax.Array, h: jax.Array
                ) -> jax.Array:
    """One decoder layer over all of h [S, H], chunk by chunk; this layer's K/V [S, K, D]
    lives only inside this program."""
    s, c = h.shape[0], config
    layer_params = jax.tree.map(lambda x: x[layer], layers)
    kv_shape = (s, c.num_kv_heads, c.head_dim)

    def attend(_, q, k, v, cache):
        k_buf, v_buf, start = cache
        k_buf = jax.lax.dynamic_update_slice(k_buf, k.astype(k_buf.dtype), (start, 0, 0))
        v_buf = jax.lax.dynamic_update_slice(v_buf, v.astype(v_buf.dtype), (start, 0, 0))
        visible = jnp.arange(s)[None, :] <= (start + jnp.arange(chunk))[:, None]  # [T, S]
        qg = q.reshape(chunk, c.num_kv_heads, c.group_size, c.head_dim).astype(jnp.float32)
        scores = llama.cap_logits(jnp.einsum("tkgd,skd->kgts", qg, k_buf.astype(jnp.float32))
                                  / np.sqrt(c.head_dim), c.attn_logit_softcap)  # [K, G, T, S]
        probs = jax.nn.softmax(jnp.where(visible[None, None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("kgts,skd->tkgd", probs, v_buf.astype(jnp.float32))  # [T, K, G, D]
        return out.reshape(chunk, c.num_heads, c.head_dim).astype(q.dtype), (k_buf, v_buf,
                                                                              start)

    def body(i, carry):
        h, k_buf, v_buf = carry
        start = i * chunk
        h_chunk = jax.lax.dynamic_slice_in_dim(h, start, chunk)  # [T, H]
        positions = start + jnp.arange(chunk, dtype=jnp.int32)
        h_chunk, (k_buf, v_buf, _) = llama.decoder_layer(
            config, attend, h_chunk, positions, layer_params, layer, (k_buf, v_buf, start))
        return jax.lax.dynamic_update_slice_in_dim(h, h_chunk, start, 0), k_buf, v_buf

    zeros = jnp.zeros(kv_shape, h.dtype)
    h, _, _ = jax.lax.fori_loop(0, s // chunk, body, (h, zeros, zeros))
    return h


# Top logprobs per position are computed for this many tokens whatever a request asks
# (OpenAI's most), so requests asking for different counts share one program.
MAX_TOP_LOGPROBS = 20


@functools.partial(jax.jit, static_argnames=("config", "chunk", "num_top"))
def _next_logprobs(config: ModelConfig, chunk: int, params, h: jax.Array, targets: jax.Array,
                   num_top: int = 0) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """[S] float32: log p(targets[i] | tokens[:i + 1]) from final hidden states h [S, H];
    the vocabulary projection runs a chunk at a time so [S, V] never exists. With
    `num_top`, also the most likely next tokens at each position: logprobs [S, num_top] and
    ids [S, num_top] (int32), most likely first, and each target's rank [S] (int32, 1: the
    most likely; one more than the tokens more likely than it)."""
    def rows(args):
        h_chunk, t_chunk = args  # [T, H], [T]
        logits = llama.lm_head(params, config, llama.final_norm(params, config, h_chunk))
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = jnp.take_along_axis(logp, t_chunk[:, None], axis=-1)[:, 0]  # [T]
        if not num_top:
            return target
        top_logp, top_ids = jax.lax.top_k(logp, num_top)  # [T, num_top] each
        rank = 1 + jnp.sum(logp > target[:, None], axis=-1, dtype=jnp.int32)  # [T]
        return target, top_logp, top_ids.astype(jnp.int32), rank

    s, hidden = h.shape
    out = jax.lax.map(rows, (h.reshape(s // chunk, chunk, hidden), targets.reshape(-1, chunk)))
    return jax.tree.map(lambda x: x.reshape(s, *x.shape[2:]), out)


@functools.partial(jax.jit, static_argnames=("config",))
def _last_logprobs(config: ModelConfig, params, h_last: jax.Array) -> jax.Array:
    """[V] float32 next-token log-probabilities from the last hidden state h_last [H]."""
    logits = llama.lm_head(params, config, llama.final_norm(params, config, h_last))
    return jax.nn.log_softmax(logits)


class PrefillOnlyScorer:
    """Scores continuations and reads next-token distributions without decode or a KV pool.

    Attributes:
      model: the model.
      chunk: tokens per layer-pass chunk (a power of two).
      max_tokens: the longest input (prompt + continuation) accepted: what one layer's K/V
        fits in `kv_budget_bytes`, rounded down to a whole chunk.
    """

    def __init__(self, model: Model, *, kv_budget_bytes: int, chunk: int = 128):
        if chunk != next_power_of_2(chunk):
            raise ValueError(f"chunk must be a power of two, got {chunk}")
        c = model.config
        self.model, self.chunk = model, chunk
        # One layer's K and V per token: what the layer pass holds.
        self.layer_kv_bytes_per_token = max(g.format.values_per_token
                                            for g in c.kv_layer_groups()) * model.dtype.itemsize
        fit = kv_budget_bytes // self.layer_kv_bytes_per_token
        self.max_tokens = min(fit // chunk * chunk, c.max_position_embeddings // chunk * chunk)

    def _bucket(self, request_id: str, num_tokens: int) -> int:
        """The padded length: a power of two, or the limit itself past the last one below it."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens exceed the "
                             f"prefill-only limit of {self.max_tokens}")
        return min(max(self.chunk, next_power_of_2(num_tokens)), self.max_tokens)

    def hidden(self, request_id: str, tokens: list[int]) -> jax.Array:
        """[S, H] final-layer hidden states (before the final norm) of `tokens`, padded."""
        s = self._bucket(request_id, len(tokens))
        padded = np.zeros(s, np.int32)
        padded[:len(tokens)] = tokens
        params, config = self.model.params, self.model.config
        h = llama.embed(params, config, jnp.asarray(padded))  # [S, H]
        for layer in range(config.num_layers):
            h = _layer_pass(config, self.chunk, params["layers"], jnp.int32(layer), h)
        return h

    def score(self, request_id: str, prompt: list[int], continuation: list[int]
              ) -> list[float]:
        """Per-token log p(continuation[j] | prompt + continuation[:j]); sum them for the
        continuation's log-probability."""
        tokens = prompt + continuation
        h = self.hidden(request_id, tokens)
        targets = np.zeros(h.shape[0], np.int32)
        targets[:len(tokens) - 1] = tokens[1:]
        logp = np.asarray(_next_logprobs(self.model.config, self.chunk, self.model.params, h,
                                         jnp.asarray(targets)))
        return logp[len(prompt) - 1:len(tokens) - 1].tolist()

    def prompt_logprobs(self, request_id: str, prompt: list[int], k: int
                        ) -> list[tuple[float, dict[int, float], int] | None]:
        """Per prompt token: None for the first, then (log p(token | tokens before it), the
        k most likely tokens there {id: logprob}, the token's rank there (1: the most
        likely)), k <= MAX_TOP_LOGPROBS. One program serves every k (the top
        MAX_TOP_LOGPROBS are computed and cut)."""
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"request {request_id!r}: k must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {k!r}")
        h = self.hidden(request_id, prompt)
        targets = np.zeros(h.shape[0], np.int32)
        targets[:len(prompt) - 1] = prompt[1:]
        logp, top_logp, top_ids, rank = (np.asarray(x) for x in _next_logprobs(
            self.model.config, self.chunk, self.model.params, h, jnp.asarray(targets),
            num_top=MAX_TOP_LOGPROBS))
        return [None] + [
            (float(logp[i]), {int(t): float(v) for t, v in zip(top_ids[i, :k], top_logp[i, :k],
                                                                strict=True)}, int(rank[i]))
            for i in range(len(prompt) - 1)]

    def top_next(self, request_id: str, prompt: list[int], k: int) -> list[tuple[int, float]]:
        """The k most likely next tokens after `prompt`, with their log-probabilities."""
        h = self.hidden(request_id, prompt)
        logp = np.asarray(_last_logprobs(self.model.config, self.model.params,
                                         h[len(prompt) - 1]))
        top = np.argsort(-logp)[:k]
        return [(int(t), float(logp[t])) for t in top]
