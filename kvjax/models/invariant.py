"""Batch-invariant numerics: a token's logits and logprobs bitwise the same whatever else is
computed beside it, in the serving step and in the training-side forward alike.

XLA's CPU matmuls and reductions choose their blocking and summation order by the shapes
they see, so a row's result changes with the number of rows (a step's batch, a prefill
chunk's length). Here every sum a token's result depends on runs in an order fixed by the
model's dimensions alone:

  matmuls        `linear.invariant_linear`: the native kernel summing over fixed ranges of
                 weight rows, added in order (its thread count and the number of rows play no
                 part)
  attention      the native decode kernel (`kvjax.kv.native`), one query per kernel row,
                 each row walked page by page in one pass (`split_rows=False`): a prefill
                 token is computed exactly as a decode token at its position
  row sums       `row_sum`, the invariant matmul against ones: RMSNorm's mean square and
                 log-softmax's sum of exponentials (XLA's CPU reduction of the same rows
                 changes its order from 128 rows on)
  running sums   `row_cumsum`, invariant matmuls against triangular ones: top-p's mass
                 (XLA's CPU cumsum is a reduce-window whose tree XLA picks); with `row_sum`
                 it makes `ROW_SUMS`, the sampler's sums
  elementwise    XLA (RoPE, SiLU, exp and log give each element the same bits whatever the
                 shape, within jitted programs; run eagerly, op by op, they may differ in
                 the last bit)

The engine's step runs this with `EngineConfig.batch_invariant`; `forward_invariant` is the
same computation over one whole sequence (the RL trainer's forward), with K/V laid out in
pages of the engine's page size so the attention kernel reads them in the same order. Both
need the native kernels (the CPU backend) and float32 parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.kv import native
from kvjax.models import linear, llama
from kvjax.sampling import RowSums

# Running sums take blocks of this many entries, then the blocks' totals (`row_cumsum`).
_CUMSUM_BLOCK = 128


def unavailable_reason() -> str | None:
    """None where batch-invariant numerics can run here, else why not."""
    if jax.default_backend() != "cpu":
        return (f"batch-invariant numerics run on the CPU backend's native kernels, not on "
                f"{jax.default_backend()!r}")
    return linear.unavailable_reason() or native.unavailable_reason()


def check(model_config: ModelConfig, param_dtype, kv_dtype) -> None:
    """Raises ValueError unless an engine of this model and these dtypes can run
    batch-invariant here."""
    reason = unavailable_reason()
    if reason is None and (any(model_config.layer_windows)
                           or len(model_config.kv_layer_groups()) > 1):
        reason = (f"model {model_config.name!r} has sliding-window layers or several KV layer "
                  f"groups, and the invariant attention reads every token of one block table")
    if reason is None and jnp.dtype(param_dtype) != jnp.float32:
        reason = f"batch-invariant numerics need float32 parameters, not {jnp.dtype(param_dtype)}"
    if reason is None and jnp.dtype(kv_dtype) != jnp.float32:
        reason = f"batch-invariant numerics read float32 pages, not {jnp.dtype(kv_dtype)}"
    if reason is not None:
        raise ValueError(f"EngineConfig.batch_invariant: {reason}")


def row_sum(x: jax.Array) -> jax.Array:
    """Sums over the last axis in an order fixed by its length. [..., H] -> [..., 1]."""
    ones = jnp.ones((1, x.shape[-1], 1), jnp.float32)  # [1, H, 1]
    sums = linear.invariant_linear(x.reshape(-1, x.shape[-1]), ones, jnp.int32(0))  # [*, 1]
    return sums.reshape(*x.shape[:-1], 1)


def _triangle(n: int, strict: bool) -> jax.Array:
    """[1, n, n] float32 ones where row j <= column i (j < i with `strict`)."""
    return jnp.asarray(np.triu(np.ones((n, n), np.float32), k=int(strict))[None])


def row_cumsum(x: jax.Array) -> jax.Array:
    """Inclusive running sums over the last axis in an order fixed by its length.
    [R, V] float32 -> [R, V].

    Within blocks of `_CUMSUM_BLOCK` entries by the invariant matmul against upper-triangular
    ones, then each block's total plus the totals of the blocks before it (another such
    matmul, strict): O(V * block) work instead of a [V, V] matrix."""
    r, v = x.shape
    c = min(_CUMSUM_BLOCK, v)
    nb = -(-v // c)
    blocks = jnp.pad(x, ((0, 0), (0, nb * c - v))).reshape(r * nb, c)  # [R*nb, C]
    within = linear.invariant_linear(blocks, _triangle(c, False), jnp.int32(0))  # [R*nb, C]
    within = within.reshape(r, nb, c)
    before = linear.invariant_linear(within[:, :, -1], _triangle(nb, True),
                                     jnp.int32(0))  # [R, nb]
    return (within + before[:, :, None]).reshape(r, nb * c)[:, :v]


ROW_SUMS = RowSums(row_sum=row_sum, cumsum=row_cumsum)


def log_softmax(logits: jax.Array) -> jax.Array:
    """log-softmax over the last axis with each row's sum in a fixed order. [R, V] -> [R, V]."""
    return ROW_SUMS.log_softmax(logits)


def attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
              block_tables: jax.Array, kv_lens: jax.Array) -> jax.Array:
    """Each query attends alone, walking its pages in one pass.

    Args:
      q: [T, N, D]; query t sees the first kv_lens[t] tokens of its block table (0: zeros).
      k_pages, v_pages: [L, num_pages, P, K, D] float32; layer: the layer to read.
      block_tables: [T, W] int32 (each query's row's table); kv_lens: [T] int32.
    Returns:
      [T, N, D].
    """
    return native.paged_decode_attention(q, k_pages, v_pages, layer, block_tables, kv_lens,
                                         split_rows=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, page_size: int) -> jax.Array:
    """Causal attention over one sequence as the engine's batch-invariant step computes it:
    K/V [S, K, D] laid out in pages of `page_size`, each query at its position. q [S, N, D].

    Differentiable: the backward pass is the dense jnp attention's."""
    s, k_heads, d = k.shape
    num_pages = -(-s // page_size)
    pad = ((0, num_pages * page_size - s), (0, 0), (0, 0))

    def pages(x):  # [1, num_pages, P, K, D]: one layer's pool
        return jnp.pad(x, pad).reshape(1, num_pages, page_size, k_heads, d)

    tables = jnp.broadcast_to(jnp.arange(num_pages, dtype=jnp.int32), (s, num_pages))
    lens = jnp.arange(1, s + 1, dtype=jnp.int32)
    return attention(q, pages(k), pages(v), jnp.int32(0), tables, lens)


def _dense_causal(q, k, v):
    s, n, d = q.shape
    group = n // k.shape[1]
    qg = q.reshape(s, k.shape[1], group, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k) / np.sqrt(d)  # [K, G, S, S]
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("kgts,skd->tkgd", probs, v).reshape(s, n, d)  # [S, N, D]


def _attention_fwd(q, k, v, page_size):
    return causal_attention(q, k, v, page_size), (q, k, v)


def _attention_bwd(page_size, residuals, grad):
    return jax.vjp(_dense_causal, *residuals)[1](grad)


causal_attention.defvjp(_attention_fwd, _attention_bwd)


def forward_invariant(params: llama.Params, config: ModelConfig, tokens: jax.Array,
                      page_size: int) -> jax.Array:
    """The full-sequence forward pass computed as the batch-invariant engine step computes
    each token (paged at `page_size`, the engine's): its logits are bitwise the engine's.

    Args:
      tokens: [S] int32 ids of one sequence.
    Returns:
      [S, V] float32 logits.
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(_, q, k, v, cache):
        return causal_attention(q, k, v, page_size), cache

    h, _ = llama.decode_body(params, config, tokens, positions, attend, None,
                             linear=linear.invariant_linear, row_sum=row_sum)
    return llama.lm_head(params, config, h, linear.invariant_linear)
