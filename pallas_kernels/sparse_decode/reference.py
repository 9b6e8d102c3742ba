"""The oracle of the sparse decode kernel: float32 jnp decode attention over the full block
table, masked to the tokens of the selected pages. Same leading arguments as the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def selected_token_mask(block_tables: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                        page_size: int) -> jax.Array:
    """[B, W * P] bool: token t of row b is read (its page is a live selected entry, t < len).

    Entry j of page_indices[b] is live when it is below the row's page count and j is below
    min(page count, R) (live entries first, as `kvjax.kv.quest.select_pages` orders them).
    """
    b, w = block_tables.shape
    num_valid = (kv_lens + page_size - 1) // page_size  # [B]
    num_live = jnp.minimum(num_valid, page_indices.shape[1])
    entry = jnp.arange(page_indices.shape[1])[None, :]  # [1, R]
    live = (entry < num_live[:, None]) & (page_indices < num_valid[:, None])  # [B, R]
    table_index = jnp.arange(w)[None, None, :]  # [1, 1, W]
    selected = jnp.any(live[:, :, None] & (page_indices[:, :, None] == table_index), axis=1)
    tokens = jnp.arange(w * page_size)[None, :]  # [1, W*P]
    return jnp.repeat(selected, page_size, axis=1) & (tokens < kv_lens[:, None])  # [B, W*P]


def sparse_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Decode attention of q [B, N, D] over the selected pages' tokens -> [B, N, D] (q's dtype).

    k_pages, v_pages: [num_pages, P, K, D]; block_tables: [B, W]; kv_lens: [B];
    page_indices: [B, R] (see `selected_token_mask`). A row with no live token gets zeros.
    """
    b, n, d = q.shape
    _, p, k_heads, _ = k_pages.shape
    w = block_tables.shape[1]
    k = k_pages[block_tables].reshape(b, w * p, k_heads, d).astype(jnp.float32)  # [B, S, K, D]
    v = v_pages[block_tables].reshape(b, w * p, k_heads, d).astype(jnp.float32)
    mask = selected_token_mask(block_tables, kv_lens, page_indices, p)  # [B, S]
    v = jnp.where(mask[:, :, None, None], v, 0.0)  # unselected pages may hold NaN
    qg = q.astype(jnp.float32).reshape(b, k_heads, n // k_heads, d)  # [B, K, G, D]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k) * scale  # [B, K, G, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = mask[:, None, None, :]  # [B, 1, 1, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)),
                        0.0)  # [B, K, G, S]
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bskd->bkgd", weights / jnp.where(denom > 0, denom, 1.0), v)
    return out.reshape(b, n, d).astype(q.dtype)
