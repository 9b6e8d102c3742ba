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

Static shapes, no token dropping. The routed experts run one of three exact ways, chosen by
the step's static token count T (`ExpertsMethod`, `default_method`):
- GATHER, while T * k <= E (decode steps): one vector-matrix product per (token, chosen expert)
  pair, each reading its expert's block through a dynamic slice (at most E unrolled pairs): the
  step reads at most T * k experts' weights, the active params. (A batched einsum over gathered
  weights was several times slower on the CPU: XLA materializes the gathered [T, k, H, Fe]
  copy.)
- GROUPED, for prefill chunks and large decode batches: the T * k (token, expert) rows are
  sorted by expert and each expert's run is padded to whole tiles of `_tile_rows` rows; a scan
  over a static number of tiles (enough for any split of the rows among the experts) multiplies
  each tile by its one expert's matrices and skips the tiles left over: about the active FLOPs
  (T * k rows plus under a tile per expert), the group sizes traced, the shapes static.
  `jax.lax.ragged_dot` states the same product, but XLA's CPU backend lowers it to a dense
  product over every group, as slow as ALL (docs/benchmarks.md, bench_moe), so it is not used.
- ALL, between the two (a few tokens, where the padding would cost more than it saves) and as
  the benchmark's baseline: every expert on every token, one [T, H] @ [H, Fe] matmul per expert
  and weight, its activations scaled by each token's routing weight (0 where the expert was not
  chosen): E / k times the active FLOPs, each expert's weights read once.

Under a native linear (`kvjax.models.linear`, steps of few tokens on the CPU) the scan hands
over the expert stacks whole ([L, E, ...], seen as [L * E, ...]) and each expert's matrix is
multiplied where it lies, as the dense layers' are; under XLA the scan hands over the layer's
slice and the experts are dynamic slices of it.
"""

from __future__ import annotations

import enum
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

# A grouped step's tiles hold up to an expert's average share of the rows (a power of two),
# between these bounds: smaller tiles waste fewer padding rows (under one tile per expert),
# larger ones pay the per-tile overhead (a weight slice, a loop iteration) fewer times. Best of
# a sweep of 8 to 256 on the CPU host at E = 8, H = Fe = 512 and 64 to 1024 tokens.
_MIN_TILE_ROWS = 32
_MAX_TILE_ROWS = 256


class ExpertsMethod(enum.Enum):
    """How a step's routed experts run (module docstring); all exact, static-shaped."""

    GATHER = "gather"  # one product per (token, chosen expert): steps with T * k <= E
    GROUPED = "grouped"  # rows sorted by expert, tiles of one expert each: large steps
    ALL = "all"  # every expert on every token: a few tokens past GATHER; the baseline


def default_method(moe: MoeConfig, num_tokens: int) -> ExpertsMethod:
    """The method a step of `num_tokens` tokens runs: GATHER while T * k <= E; then ALL while
    the grouped step's padded rows (T * k plus under a tile per expert) are at least the E * T
    of running every expert (a few tokens past the gathered steps: each expert's weights are
    read once either way); GROUPED beyond."""
    m, t = moe, num_tokens
    rows = t * m.num_experts_per_tok
    if rows <= m.num_experts:
        return ExpertsMethod.GATHER
    tile = _tile_rows(rows, m.num_experts)
    if _num_tiles(rows, m.num_experts, tile) * tile >= m.num_experts * t:
        return ExpertsMethod.ALL
    return ExpertsMethod.GROUPED


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
                   linear: LayerLinear | None = None, method: ExpertsMethod | None = None
                   ) -> jax.Array:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]): [T, H] from x [T, H], exact (see the
    module docstring for the ways; `method` None: `default_method`). The expert params are one
    layer's ([E, ...]), or whole stacks ([L, E, ...]) read at `layer_index`, by `linear` when
    given."""
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

    method = default_method(moe, t) if method is None else method
    if method is ExpertsMethod.GATHER:
        out = []
        for row in range(t):
            acc = jnp.zeros((1, x.shape[1]), f32)
            for j in range(k):
                ex = experts[row, j]
                act = expert(x[row][None], ex).astype(x.dtype)  # [1, Fe]
                acc = acc + weights[row, j] * times(act, 2, ex)
            out.append(acc)
        return jnp.concatenate(out).astype(x.dtype)  # [T, H]
    if method is ExpertsMethod.GROUPED:
        return _grouped(x, weights, experts, e, expert, times)
    combine = jnp.zeros((t, e), f32).at[jnp.arange(t)[:, None], experts].add(
        weights)  # [T, E]: 0 for the experts not chosen
    acc = jnp.zeros(x.shape, f32)
    for i in range(e):
        act = (expert(x, i) * combine[:, i, None]).astype(x.dtype)  # [T, Fe]
        acc = acc + times(act, 2, i)
    return acc.astype(x.dtype)  # [T, H]


def _tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile of a grouped step of `num_rows` (token, expert) rows: a power of two."""
    share = max(1, num_rows // num_experts)
    return int(np.clip(1 << (share.bit_length() - 1), _MIN_TILE_ROWS, _MAX_TILE_ROWS))


def _num_tiles(num_rows: int, num_experts: int, tile: int) -> int:
    """Tiles enough for any split of `num_rows` rows among the experts, each expert's run
    padded to whole tiles."""
    return (num_rows + num_experts * (tile - 1)) // tile


def grouped_layout(experts: jax.Array, num_experts: int, tile: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Where each (token, chosen expert) row goes in a grouped step.

    Rows are sorted by expert; each expert's run starts on a tile boundary, in
    `_num_tiles(T * k, E, tile)` tiles.

    Args:
      experts: [T, k] int32 chosen experts.
    Returns:
      (tile_expert [num_tiles] int32: each tile's expert, E for a tile left over,
       slot_row [num_tiles * tile] int32: the flat row (token * k + j) in each slot, R where
       the slot is padding).
    """
    t, k = experts.shape
    num_rows = t * k
    num_tiles = _num_tiles(num_rows, num_experts, tile)
    flat = experts.reshape(-1)  # [R]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [R] flat rows by expert
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)  # [E]
    starts = jnp.cumsum(sizes) - sizes  # [E] each expert's first row in sorted order
    padded = (sizes + tile - 1) // tile * tile  # [E]
    padded_ends = jnp.cumsum(padded)  # [E]
    sorted_experts = flat[order]  # [R]
    slot = (padded_ends - padded)[sorted_experts] + (
        jnp.arange(num_rows, dtype=jnp.int32) - starts[sorted_experts])  # [R]
    slot_row = jnp.full(num_tiles * tile, num_rows, jnp.int32).at[slot].set(order)
    tile_expert = jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * tile, side="right")
    return tile_expert.astype(jnp.int32), slot_row


def _grouped(x: jax.Array, weights: jax.Array, experts: jax.Array, num_experts: int,
             expert: Callable[[jax.Array, jax.Array], jax.Array],
             times: Callable[[jax.Array, int, jax.Array], jax.Array]) -> jax.Array:
    """The grouped method: [T, H]. `expert(rows, i)` gives expert i's hidden activations,
    `times(act, 2, i)` its down projection."""
    t, k = experts.shape
    tile = _tile_rows(t * k, num_experts)
    tile_expert, slot_row = grouped_layout(experts, num_experts, tile)
    num_tiles = tile_expert.shape[0]
    slot_token = jnp.where(slot_row < t * k, slot_row // k, t)  # [num_tiles * tile]; T: padding
    slot_weight = jnp.concatenate([weights.reshape(-1), jnp.zeros(1, weights.dtype)])[
        slot_row]  # [num_tiles * tile]; 0 for padding
    rows = jnp.take(x, slot_token, axis=0, mode="fill", fill_value=0)  # [num_tiles * tile, H]

    def run_tile(_, xs):
        tile_rows, tile_weights, i = xs  # [tile, H], [tile], scalar

        def multiply():
            act = (expert(tile_rows, i) * tile_weights[:, None]).astype(x.dtype)  # [tile, Fe]
            return times(act, 2, i)  # [tile, H] float32

        return None, jax.lax.cond(i < num_experts, multiply,
                                  lambda: jnp.zeros(tile_rows.shape, jnp.float32))

    _, out_rows = jax.lax.scan(run_tile, None, (
        rows.reshape(num_tiles, tile, -1), slot_weight.reshape(num_tiles, tile), tile_expert))
    out = jnp.zeros(x.shape, jnp.float32).at[slot_token].add(
        out_rows.reshape(num_tiles * tile, -1), mode="drop")  # [T, H]
    return out.astype(x.dtype)


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
