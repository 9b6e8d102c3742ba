"""A Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, SmolLM2, Gemma 2/3): pure functions
over params.

Params pytree (weights in `x @ W` orientation; per-layer tensors stacked on a leading L axis so
the layer loop is one `lax.scan`):

  embed:        [V, H]
  final_norm:   [H]
  lm_head:      [H, V]           only when the embedding is not tied
  layers:
    attn_norm:  [L, H]
    wq:         [L, H, N*D]      Q/K use the rotate-half RoPE convention (Hugging Face's)
    wk, wv:     [L, H, K*D]
    bq:         [L, N*D]         only with qkv_bias (Qwen2)
    bk, bv:     [L, K*D]         only with qkv_bias
    q_norm:     [L, D]           only with qk_norm (Qwen3, Gemma 3): per-head RMSNorm before RoPE
    k_norm:     [L, D]           only with qk_norm
    wo:         [L, N*D, H]
    post_attn_norm: [L, H]       only with sandwich_norms (Gemma): on the attention output
    mlp_norm:   [L, H]
    w_gate:     [L, H, F]
    w_up:       [L, H, F]
    w_down:     [L, F, H]        a mixture-of-experts model (`ModelConfig.moe`) has its experts'
                                 params instead (`kvjax.models.moe`), and these only when some
                                 of its layers are dense
    post_mlp_norm: [L, H]        only with sandwich_norms: on the MLP output

A model with multi-head latent attention (`ModelConfig.mla`, DeepSeek-V2/V3) has other attention
params in place of wq, wk, wv, wo (`kvjax.models.mla`); its cache holds one latent per token.

Gemma's differences are static branches on `ModelConfig` fields (norms scaling by 1 + w, scaled
embeddings, GeGLU, sandwich norms, the query scale, logit soft caps, a second RoPE for local
layers), so the compiled programs of the other architectures are unchanged.

The decoder takes an `attend` callback per layer, so the same model body serves every KV layout
(contiguous, paged, quantized, sparse): the callback writes the new K/V into the cache and returns
the attention output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import MlpActivation, ModelConfig
from kvjax.models import linear as linear_lib
from kvjax.models import mla, moe
from kvjax.models.linear import LayerLinear
from kvjax.models.rope import apply_selected, selected_tables

Params = dict[str, Any]

# attend(layer_index, q [T, N, D], k [T, K, D], v [T, K, D], cache) -> (out [T, N, D], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# matmul(x [T, In], w) -> [T, Out]: a layer's matrix product (w as decoder_layer was given it).
Matmul = Callable[[jax.Array, jax.Array], jax.Array]
# row_sum(x [..., H]) -> [..., 1]: the sums RMSNorm takes (`kvjax.models.invariant.row_sum`
# sums in a fixed order; None: XLA's reduction).
RowSum = Callable[[jax.Array], jax.Array]
# write_kv(layer_index, x [T, H], layer_params, positions [T], cache) -> cache: projects a block's
# normed input x to its keys and values and writes them into the cache itself (the fused KV
# write, `kvjax.kv.fused_write`); the block then computes only its queries, and `attend` gets
# None for k and v.
KVWriter = Callable[[jax.Array, jax.Array, Params, jax.Array, Any], Any]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, unit_offset: bool = False,
             row_sum: RowSum | None = None) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype. x: [..., H]; scales by (1 + weight) with
    `unit_offset` (Gemma), else by weight; `row_sum` takes the sum of squares (None: XLA's)."""
    x32 = x.astype(jnp.float32)
    if row_sum is None:
        mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    else:
        mean_square = row_sum(x32 * x32) / x.shape[-1]
    x32 = x32 * jax.lax.rsqrt(mean_square + eps)
    w32 = weight.astype(jnp.float32)
    return (x32 * (1.0 + w32 if unit_offset else w32)).astype(x.dtype)


def norm(config: ModelConfig, x: jax.Array, weight: jax.Array,
         row_sum: RowSum | None = None) -> jax.Array:
    """The model's RMSNorm (its eps and weight convention). x: [..., H or D]."""
    return rms_norm(x, weight, config.rms_norm_eps, unit_offset=config.norm_unit_offset,
                    row_sum=row_sum)


def cap_logits(x: jax.Array, cap: float | None) -> jax.Array:
    """Soft cap: cap * tanh(x / cap), or x when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embeddings [T, H] of tokens [T], times sqrt(H) in the params' dtype when
    `scale_embeddings` (Gemma rounds the factor to that dtype too)."""
    h = params["embed"][tokens]
    if config.scale_embeddings:
        h = h * jnp.asarray(np.sqrt(config.hidden_size), h.dtype)
    return h


def final_norm(params: Params, config: ModelConfig, h: jax.Array,
               row_sum: RowSum | None = None) -> jax.Array:
    """The final RMSNorm before the output projection. h: [..., H]."""
    return norm(config, h, params["final_norm"], row_sum)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02
                ) -> Params:
    """Random params (normal * scale, norms at 1) for tests and synthetic benchmarks."""
    c = config
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {name: (c.num_layers, *shape) for name, shape in _attention_shapes(c).items()
              if name not in mla.NORMS}
    shapes.update({name: (c.num_layers, *shape) for name, shape in _mlp_shapes(c).items()})
    if c.qkv_bias:
        shapes.update(bq=(c.num_layers, nd), bk=(c.num_layers, kd), bv=(c.num_layers, kd))
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {
        name: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        for k, (name, shape) in zip(keys[2:], sorted(shapes.items()), strict=True)
    }
    # Norm weights that make each norm a plain RMS normalization: 0 where it scales by 1 + w.
    unit = jnp.zeros if c.norm_unit_offset else jnp.ones
    norms = ["attn_norm", "mlp_norm"] + (["post_attn_norm", "post_mlp_norm"]
                                         if c.sandwich_norms else [])
    for name in norms:
        layers[name] = unit((c.num_layers, c.hidden_size), dtype)
    for name, shape in _attention_shapes(c).items():
        if name in mla.NORMS:
            layers[name] = unit((c.num_layers, *shape), dtype)
    if c.qk_norm:
        layers["q_norm"] = unit((c.num_layers, c.head_dim), dtype)
        layers["k_norm"] = unit((c.num_layers, c.head_dim), dtype)
    params = {
        "embed": (scale * jax.random.normal(keys[0], (c.vocab_size, c.hidden_size))).astype(dtype),
        "final_norm": unit((c.hidden_size,), dtype),
        "layers": layers,
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = (
            scale * jax.random.normal(keys[1], (c.hidden_size, c.vocab_size))).astype(dtype)
    return params


def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes (no L axis) of the attention's params: Q, K, V and O, or MLA's."""
    c = config
    if c.mla is not None:
        return mla.attention_shapes(c)
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"wq": (c.hidden_size, nd), "wk": (c.hidden_size, kd), "wv": (c.hidden_size, kd),
            "wo": (nd, c.hidden_size)}


def _mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes (no L axis) of the MLP's params: the dense MLP's, a mixture of experts'
    (`kvjax.models.moe`), or both where some layers of a MoE model are dense."""
    c = config
    dense = {"w_gate": (c.hidden_size, c.intermediate_size),
             "w_up": (c.hidden_size, c.intermediate_size),
             "w_down": (c.intermediate_size, c.hidden_size)}
    if c.moe is None:
        return dense
    return {**(dense if c.moe.dense_layers else {}), **moe.param_shapes(c)}


def check_params(params: Params, config: ModelConfig) -> None:
    """Raises ValueError naming the first tensor whose presence or shape does not fit `config`."""
    c = config
    nd, kd, L = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_layers
    expected = {
        ("embed",): (c.vocab_size, c.hidden_size),
        ("final_norm",): (c.hidden_size,),
        ("layers", "attn_norm"): (L, c.hidden_size),
        **{("layers", name): (L, *shape) for name, shape in _attention_shapes(c).items()},
        ("layers", "mlp_norm"): (L, c.hidden_size),
        **{("layers", name): (L, *shape) for name, shape in _mlp_shapes(c).items()},
    }
    if not c.tie_word_embeddings:
        expected[("lm_head",)] = (c.hidden_size, c.vocab_size)
    if c.qkv_bias:
        expected.update({("layers", "bq"): (L, nd), ("layers", "bk"): (L, kd),
                         ("layers", "bv"): (L, kd)})
    if c.qk_norm:
        expected.update({("layers", "q_norm"): (L, c.head_dim),
                         ("layers", "k_norm"): (L, c.head_dim)})
    if c.sandwich_norms:
        expected.update({("layers", "post_attn_norm"): (L, c.hidden_size),
                         ("layers", "post_mlp_norm"): (L, c.hidden_size)})
    for path, shape in expected.items():
        node: Any = params
        for part in path:
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"params are missing {'/'.join(path)} (expected shape {shape})")
            node = node[part]
        if tuple(node.shape) != shape:
            raise ValueError(
                f"params {'/'.join(path)} has shape {tuple(node.shape)}, expected {shape}")


def _local_rope_index(config: ModelConfig) -> np.ndarray:
    """[L] int32: 1 for the layers of `local_rope`, 0 for the others."""
    index = np.zeros(config.num_layers, np.int32)
    index[list(config.local_rope_layers)] = 1
    return index


def apply_rope(config: ModelConfig, x: jax.Array, positions: jax.Array,
               layer_index: jax.Array) -> jax.Array:
    """x [T, heads, D] embedded at positions [T] by layer `layer_index`'s RoPE."""
    if config.local_rope is None:
        return config.rope.apply(x, positions)
    choice = jnp.asarray(_local_rope_index(config))[layer_index]
    return apply_selected((config.rope, config.local_rope), choice, x, positions)


def rope_tables(config: ModelConfig, positions: jax.Array, layer_index: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, D/2] that `apply_rope` turns layer `layer_index`'s heads by."""
    if config.local_rope is None:
        return config.rope.tables(positions, config.head_dim)
    choice = jnp.asarray(_local_rope_index(config))[layer_index]
    return selected_tables((config.rope, config.local_rope), choice, positions,
                           config.head_dim)


def queries(config: ModelConfig, layer_params: Params, x: jax.Array, positions: jax.Array,
            layer_index: jax.Array, matmul: Matmul = linear_lib.matmul,
            row_sum: RowSum | None = None) -> jax.Array:
    """A block's queries [T, N, D] (RoPE applied) from its normed input x [T, H].

    Attention everywhere scales logits by D**-0.5, so a model's other query scale
    (`query_pre_attn_scalar`) is folded into the queries here: every attention path, kernel
    and retention score then sees the model's logits unchanged."""
    c = config
    p = layer_params
    q = matmul(x, p["wq"])  # [T, N*D]
    if c.qkv_bias:
        q = q + p["bq"]
    q = q.reshape(x.shape[0], c.num_heads, c.head_dim)  # [T, N, D]
    if c.qk_norm:
        q = norm(c, q, p["q_norm"], row_sum)
    q = apply_rope(c, q, positions, layer_index)
    if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != c.head_dim:
        q = (q.astype(jnp.float32) * (c.attn_scale * np.sqrt(c.head_dim))).astype(q.dtype)
    return q


def qkv(config: ModelConfig, layer_params: Params, h: jax.Array, positions: jax.Array,
        layer_index: jax.Array, matmul: Matmul = linear_lib.matmul, row_sum: RowSum | None = None
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A block's queries [T, N, D], keys and values [T, K, D] (RoPE applied) from h [T, H]
    (the queries as `queries` makes them)."""
    c = config
    p = layer_params
    t = h.shape[0]
    x = norm(c, h, p["attn_norm"], row_sum)
    q = queries(c, p, x, positions, layer_index, matmul, row_sum)  # [T, N, D]
    k = matmul(x, p["wk"])  # [T, K*D]
    v = matmul(x, p["wv"])
    if c.qkv_bias:
        k, v = k + p["bk"], v + p["bv"]
    k = k.reshape(t, c.num_kv_heads, c.head_dim)  # [T, K, D]
    if c.qk_norm:
        k = norm(c, k, p["k_norm"], row_sum)
    k = apply_rope(c, k, positions, layer_index)
    return q, k, v.reshape(t, c.num_kv_heads, c.head_dim)


def dense_mlp(config: ModelConfig, p: Params, x: jax.Array, matmul: Matmul = linear_lib.matmul
              ) -> jax.Array:
    """The gated MLP down(act(x @ w_gate) * (x @ w_up)). x: [T, H] -> [T, H]."""
    gate = matmul(x, p["w_gate"]).astype(jnp.float32)  # [T, F]
    if config.activation is MlpActivation.GELU_TANH:
        gate = jax.nn.gelu(gate, approximate=True)
    else:
        gate = jax.nn.silu(gate)
    return matmul(gate.astype(x.dtype) * matmul(x, p["w_up"]), p["w_down"])  # [T, H]


def mlp(config: ModelConfig, p: Params, x: jax.Array, layer_index: jax.Array,
        matmul: Matmul = linear_lib.matmul, linear: LayerLinear | None = None) -> jax.Array:
    """Layer `layer_index`'s MLP (dense, or mixture of experts: `kvjax.models.moe`, whose
    experts `linear` reads in place when given). x: [T, H], already through mlp_norm -> [T, H].
    """
    if config.moe is None:
        return dense_mlp(config, p, x, matmul)
    if not config.moe.dense_layers:
        return moe.moe_mlp(config, p, x, matmul, layer_index, linear)
    is_dense = jnp.asarray(moe.dense_layer_flags(config))[layer_index]
    return jax.lax.cond(is_dense, lambda: dense_mlp(config, p, x, matmul),
                        lambda: moe.moe_mlp(config, p, x, matmul, layer_index, linear))


def decoder_layer(config: ModelConfig, attend: AttendFn, h: jax.Array, positions: jax.Array,
                  layer_params: Params, layer_index: jax.Array, cache: Any,
                  matmul: Matmul = linear_lib.matmul, row_sum: RowSum | None = None,
                  write_kv: KVWriter | None = None,
                  linear: LayerLinear | None = None) -> tuple[jax.Array, Any]:
    """One decoder block. h: [T, H]. `matmul(x, w)` multiplies by one of layer_params' matrices
    (x @ w accumulated in float32 by default); `row_sum` takes RMSNorm's sums (None: XLA's);
    `write_kv` writes the block's K and V into the cache itself (None: `attend` gets them)."""
    c = config
    p = layer_params
    t = h.shape[0]
    if c.mla is not None:
        out, cache = mla.attention(c, attend, norm(c, h, p["attn_norm"], row_sum), positions, p,
                                   layer_index, cache, matmul,
                                   lambda x, w: norm(c, x, w, row_sum))  # [T, H]
    elif write_kv is not None:
        x = norm(c, h, p["attn_norm"], row_sum)
        q = queries(config, p, x, positions, layer_index, matmul, row_sum)  # [T, N, D]
        cache = write_kv(layer_index, x, p, positions, cache)
        attn, cache = attend(layer_index, q, None, None, cache)  # [T, N, D]
        out = matmul(attn.reshape(t, -1).astype(h.dtype), p["wo"])  # [T, H]
    else:
        q, k, v = qkv(config, p, h, positions, layer_index, matmul, row_sum)
        attn, cache = attend(layer_index, q, k, v, cache)  # [T, N, D]
        out = matmul(attn.reshape(t, -1).astype(h.dtype), p["wo"])  # [T, H]
    h = h + (norm(c, out, p["post_attn_norm"], row_sum) if c.sandwich_norms else out)
    out = mlp(c, p, norm(c, h, p["mlp_norm"], row_sum), layer_index, matmul, linear)  # [T, H]
    h = h + (norm(c, out, p["post_mlp_norm"], row_sum) if c.sandwich_norms else out)
    return h, cache


def decode_body(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                attend: AttendFn, cache: Any, linear: LayerLinear | None = None,
                row_sum: RowSum | None = None, write_kv: KVWriter | None = None
                ) -> tuple[jax.Array, Any]:
    """Runs the decoder over packed tokens and returns final hidden states [T, H] and the cache.

    Args:
      tokens: [T] int32 token ids (sequences packed along one axis).
      positions: [T] int32 position of each token in its own sequence.
      attend: the KV-layout specific attention (see module docstring).
      cache: whatever `attend` threads through the layers (donated KV buffers).
      linear: multiplies by a layer of the stacked matrices, reading it where it lies
        (`kvjax.models.linear.native_linear`); None: XLA matmuls of the scan's layer slices.
      row_sum: takes RMSNorm's sums (`kvjax.models.invariant.row_sum`); None: XLA's.
      write_kv: writes each block's K and V into the cache itself (`KVWriter`; the layer's
        matrices come to it as the scan's slices [In, Out], or stacked [L, In, Out] with
        `linear`); None: `attend` gets them.
    """
    h = embed(params, config, tokens)  # [T, H]
    layers = params["layers"]
    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    if linear is None:
        def body(carry, xs):
            h, cache = carry
            layer_params, layer_index = xs
            h, cache = decoder_layer(config, attend, h, positions, layer_params, layer_index,
                                     cache, row_sum=row_sum, write_kv=write_kv)
            return (h, cache), None

        (h, cache), _ = jax.lax.scan(body, (h, cache), (layers, layer_ids))
    else:
        def body(carry, layer_index):
            h, cache = carry
            # Matrices ([L, In, Out]) stay whole for `linear`, and expert stacks ([L, ...],
            # 4-D) for `kvjax.models.moe` to read only the chosen experts; norms and biases
            # are sliced.
            layer_params = {name: w if w.ndim >= 3 else w[layer_index]
                            for name, w in layers.items()}
            h, cache = decoder_layer(
                config, attend, h, positions, layer_params, layer_index, cache,
                matmul=lambda x, w: linear(x, w, layer_index), row_sum=row_sum,
                write_kv=write_kv, linear=linear)
            return (h, cache), None

        (h, cache), _ = jax.lax.scan(body, (h, cache), layer_ids)
    return final_norm(params, config, h, row_sum), cache


def lm_head(params: Params, config: ModelConfig, h: jax.Array,
            linear: LayerLinear | None = None) -> jax.Array:
    """Logits in float32 (soft-capped by `final_logit_softcap`). h: [..., H] -> [..., V].
    `linear`: as in `decode_body` (None: XLA)."""
    if linear is not None and h.dtype in (jnp.float32, jnp.bfloat16):
        x = h.reshape(-1, h.shape[-1])
        out = {} if h.dtype == jnp.float32 else dict(out_dtype=jnp.float32)  # unrounded sums
        if config.tie_word_embeddings:  # embed [V, H]: its transpose
            logits = linear(x, params["embed"][None], jnp.int32(0), transpose=True, **out)
        else:
            logits = linear(x, params["lm_head"][None], jnp.int32(0), **out)
        logits = logits.reshape(*h.shape[:-1], -1)
    else:
        # Several rows of bfloat16 against embed [V, H] as it lies: through a transpose, XLA's
        # CPU pipeline widened the embedding to a float32 copy in every step (YNNPACK takes it
        # as it is). A single row goes to XLA's matrix-vector product, faster through the
        # transpose.
        if config.tie_word_embeddings and h.size == h.shape[-1]:
            logits = jnp.einsum("...h,hv->...v", h, params["embed"].T,
                                preferred_element_type=jnp.float32)
        elif config.tie_word_embeddings:
            logits = jnp.einsum("...h,vh->...v", h, params["embed"],
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("...h,hv->...v", h, params["lm_head"],
                                preferred_element_type=jnp.float32)
    return cap_logits(logits, config.final_logit_softcap)


def forward_dense(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full-sequence causal forward pass without a KV cache: the model-level oracle.

    Args:
      tokens: [T] int32 ids of one sequence.
    Returns:
      [T, V] float32 logits.
    """
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S=T]
    windows = jnp.asarray([config.layer_window(i) for i in range(config.num_layers)], jnp.int32)
    behind = positions[:, None] - positions[None, :]  # [T, S]: how far each key lies back

    def attend(layer, q, k, v, cache):
        window = windows[layer]
        visible = causal & ((window <= 0) | (behind < window))  # [T, S]
        g = config.group_size
        qg = q.reshape(t, config.num_kv_heads, g, config.head_dim).astype(jnp.float32)
        scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32))
        scores = cap_logits(scores / np.sqrt(config.head_dim), config.attn_logit_softcap)
        scores = jnp.where(visible[None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)  # [K, G, T, S]
        out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))  # [T, K, G, D]
        return out.reshape(t, config.num_heads, config.head_dim).astype(q.dtype), cache

    h, _ = decode_body(params, config, tokens, positions, attend, None)
    return lm_head(params, config, h)
