"""Mixture-of-experts MLPs (Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2/V3): pure functions.

A MoE layer's params (`x @ W` orientation, stacked on a leading L axis like the rest of
`kvjax.models.llama`'s pytree; E experts of hidden size Fe, shared expert of Fs):

  router:         [L, H, E]
  router_bias:    [L, E]        only with `MoeConfig.score_bias` (DeepSeek-V3's choice bias)
  w_gate_exps:    [L, E, H, Fe]  expert-major: each expert's matrix is one contiguous block
  w_up_exps:      [L, E, H, Fe]
  w_down_exps:    [L, E, Fe, H]
  w_gate_shared:  [L, H, Fs]    only with a shared expert
  w_up_shared:    [L, H, Fs]
  w_down_shared:  [L, Fs, H]
  shared_gate:    [L, H, 1]     only with `MoeConfig.shared_gate` (Qwen2-MoE)

A model whose first layers are dense (DeepSeek's `first_k_dense_replace`) also holds the dense
MLP's w_gate / w_up / w_down [L, ...] on every layer, so the layer loop stays one scan: each
layer runs one of the two MLPs (`lax.cond`), and the params of the other are zeros, never read
into the result. That costs memory (a dense MLP per MoE layer, the experts of each dense
layer), not time.

Static shapes, no token dropping. The routed experts run one of two exact ways, chosen by the
step's static token count T:
- T * k <= E (decode steps): one vector-matrix product per (token, chosen expert) pair, each
  reading its expert's block through a dynamic slice (at most E unrolled pairs): the step reads
  at most T * k experts' weights, the active params. (A batched einsum over gathered weights
  was several times slower on the CPU: XLA materializes the gathered [T, k, H, Fe] copy.)
- otherwise (prefill chunks, large decode batches): every expert runs on every token, one
  [T, H] @ [H, Fe] matmul per expert and weight (E unrolled), its activations scaled by each
  token's routing weight (0 where the expert was not chosen) before the down projection: E / k
  times the active FLOPs, no gather; with many tokens nearly every expert is chosen anyway.

Under a native linear (`kvjax.models.linear`, steps of few tokens on the CPU) the scan hands
over the expert stacks whole ([L, E, ...], seen as [L * E, ...]) and each expert's matrix is
multiplied where it lies, as the dense layers' are; under XLA the scan hands over the layer's
slice and the experts are dynamic slices of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig, MoeConfig, MoeScoring
from kvjax.models.linear import LayerLinear

Params = dict[str, Any]
# matmul(x [T, In], w [In, Out]) -> [T, Out]: a matrix of the layer's params (3-D stacks).
Matmul = Callable[[jax.Array, jax.Array], jax.Array]

# Grouped routing of sigmoid scores ranks a group by the sum of its best two (DeepSeek-V3).
_SIGMOID_GROUP_TOP = 2


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes (no L axis; [in, out] for matrices) of a MoE layer's params."""
    m, h = config.moe, config.hidden_size
    e, fe = m.num_experts, m.expert_size
    shapes: dict[str, tuple[int, ...]] = {
        "router": (h, e), "w_gate_exps": (e, h, fe), "w_up_exps": (e, h, fe),
        "w_down_exps": (e, fe, h)}
    if m.score_bias:
        shapes["router_bias"] = (e,)
    if m.shared_size:
        shapes.update(w_gate_shared=(h, m.shared_size), w_up_shared=(h, m.shared_size),
                      w_down_shared=(m.shared_size, h))
    if m.shared_gate:
        shapes["shared_gate"] = (h, 1)
    return shapes


def route(moe: MoeConfig, logits: jax.Array, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """The experts each token runs through and their weights.

    Args:
      logits: [T, E] router logits.
      bias: [E] the choice bias (`MoeConfig.score_bias`), or None.
    Returns:
      (weights [T, k] float32, experts [T, k] int32).
    """
    m = moe
    logits = logits.astype(jnp.float32)
    if m.scoring is MoeScoring.SIGMOID:
        scores = jax.nn.sigmoid(logits)  # [T, E]
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
    else:
        scores = jax.nn.softmax(logits, axis=-1)  # [T, E]
        choice = scores
    if m.num_groups > 1:
        choice = _limit_to_groups(m, choice)
    _, experts = jax.lax.top_k(choice, m.num_experts_per_tok)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # [T, k]
    if m.norm_topk_prob:
        denominator = jnp.sum(weights, axis=-1, keepdims=True)
        if m.scoring is MoeScoring.SIGMOID:  # sigmoid scores may all be tiny
            denominator = denominator + 1e-20
        weights = weights / denominator
    return weights * m.routed_scaling, experts.astype(jnp.int32)


def _limit_to_groups(moe: MoeConfig, choice: jax.Array) -> jax.Array:
    """`choice` [T, E] with the experts outside each token's `topk_groups` best groups out of
    the competition (-inf for sigmoid scores, 0 for softmax probabilities, as DeepSeek's)."""
    m = moe
    t = choice.shape[0]
    grouped = choice.reshape(t, m.num_groups, m.num_experts // m.num_groups)  # [T, G, E/G]
    if m.scoring is MoeScoring.SIGMOID:
        group_scores = jnp.sum(jax.lax.top_k(grouped, _SIGMOID_GROUP_TOP)[0], axis=-1)
        outside = -jnp.inf
    else:
        group_scores = jnp.max(grouped, axis=-1)
        outside = 0.0
    _, best = jax.lax.top_k(group_scores, m.topk_groups)  # [T, topk_groups]
    keep = jnp.zeros((t, m.num_groups), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, outside).reshape(t, m.num_experts)


def _swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            matmul: Matmul) -> jax.Array:
    gate = jax.nn.silu(matmul(x, w_gate).astype(jnp.float32)).astype(x.dtype)
    return matmul(gate * matmul(x, w_up), w_down)


def routed_experts(moe: MoeConfig, p: Params, x: jax.Array, weights: jax.Array,
                   experts: jax.Array, layer_index: jax.Array | None = None,
                   linear: LayerLinear | None = None) -> jax.Array:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]): [T, H] from x [T, H], exact (see the
    module docstring for the two ways, picked by T). The expert params are one layer's
    ([E, ...]), or whole stacks ([L, E, ...]) read at `layer_index`, by `linear` when given."""
    f32 = jnp.float32
    t, k, e = x.shape[0], moe.num_experts_per_tok, moe.num_experts
    stacks = [p["w_gate_exps"], p["w_up_exps"], p["w_down_exps"]]
    if stacks[0].ndim == 4 and linear is not None:
        flat = [w.reshape(-1, *w.shape[2:]) for w in stacks]  # [L * E, In, Out]

        def times(rows, which, i):
            return linear(rows, flat[which], layer_index * e + i).astype(f32)
    else:
        if stacks[0].ndim == 4:  # whole stacks under XLA: this layer's
            stacks = [jax.lax.dynamic_index_in_dim(w, layer_index, 0, keepdims=False)
                      for w in stacks]

        def times(rows, which, i):
            w = jax.lax.dynamic_index_in_dim(stacks[which], i, 0, keepdims=False)
            return jnp.matmul(rows, w, preferred_element_type=f32)

    def expert(rows: jax.Array, i: jax.Array | int) -> jax.Array:
        """Expert i's SwiGLU hidden activations [R, Fe] (float32) on rows [R, H]."""
        return jax.nn.silu(times(rows, 0, i)) * times(rows, 1, i)

    if t * k <= e:
        out = []
        for row in range(t):
            acc = jnp.zeros((1, x.shape[1]), f32)
            for j in range(k):
                ex = experts[row, j]
                act = expert(x[row][None], ex).astype(x.dtype)  # [1, Fe]
                acc = acc + weights[row, j] * times(act, 2, ex)
            out.append(acc)
        return jnp.concatenate(out).astype(x.dtype)  # [T, H]
    combine = jnp.zeros((t, e), f32).at[jnp.arange(t)[:, None], experts].add(
        weights)  # [T, E]: 0 for the experts not chosen
    acc = jnp.zeros(x.shape, f32)
    for i in range(e):
        act = (expert(x, i) * combine[:, i, None]).astype(x.dtype)  # [T, Fe]
        acc = acc + times(act, 2, i)
    return acc.astype(x.dtype)  # [T, H]


def moe_mlp(config: ModelConfig, p: Params, x: jax.Array, matmul: Matmul,
            layer_index: jax.Array | None = None, linear: LayerLinear | None = None
            ) -> jax.Array:
    """One layer's MoE MLP. x: [T, H], already through the layer's mlp_norm. Returns [T, H].

    `matmul(x, w)` multiplies by the router and shared-expert matrices (3-D stacks under a
    native linear); the experts (one layer's, or whole stacks read at `layer_index`) are
    multiplied by XLA."""
    m = config.moe
    weights, experts = route(m, matmul(x, p["router"]), p.get("router_bias"))
    out = routed_experts(m, p, x, weights, experts, layer_index, linear)
    if m.shared_size:
        shared = _swiglu(x, p["w_gate_shared"], p["w_up_shared"], p["w_down_shared"], matmul)
        if m.shared_gate:
            gate = jax.nn.sigmoid(matmul(x, p["shared_gate"]).astype(jnp.float32))  # [T, 1]
            shared = (gate * shared.astype(jnp.float32)).astype(x.dtype)
        out = out + shared
    return out


def dense_layer_flags(config: ModelConfig) -> np.ndarray:
    """[L] bool: the layers of a MoE model that run the dense MLP."""
    flags = np.zeros(config.num_layers, bool)
    flags[list(config.moe.dense_layers)] = True
    return flags
