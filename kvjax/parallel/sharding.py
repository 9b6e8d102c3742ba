"""Tensor parallelism over a `jax.sharding.Mesh`: which axis of each tensor the `tp` axis splits.

Megatron-style layout (weights in `x @ W` orientation, see `kvjax.models.llama`):

  wq [L, H, N*D], bq [L, N*D]        columns split: each device holds N/tp whole query heads
  wk, wv [L, H, K*D], bk, bv [L, K*D] columns split: each device holds K/tp whole kv heads
  wo [L, N*D, H]                      rows split (row parallel: partial sums are all-reduced)
  w_gate, w_up [L, H, F]              columns split on F
  w_down [L, F, H]                    rows split on F (all-reduced)
  embed, norms, lm_head               replicated
  KV pages [L, num_pages, P, K, D]    the kv-head axis split: a device holds its heads' pages

Query head n reads kv head n // G, so the block of N/tp query heads on a device reads exactly
the K/tp kv heads stored beside it: attention needs no communication, and each layer costs two
all-reduces of [T, H] (after wo and after w_down). XLA inserts them from these shardings.
The Pallas kernels (`attention_impl=pallas`) are opaque calls XLA cannot split, so on a mesh
each runs under `shard_map` on every device's own heads (`shard_kernels`).

Block tables, slot mappings and every other step input are small host arrays, replicated on
all devices. Data parallelism is one engine per `dp` replica, each over its own tp sub-mesh
(`replica_meshes`), with a `kvjax.router.Router` spreading requests over the replicas: the
replicas share nothing, so their page pools and prefix caches are independent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax import jit as kvjax_jit
from kvjax.config import ModelConfig
from kvjax.engine import compat
from kvjax.engine.config import EngineConfig
from kvjax.engine.step import MatmulImpl, StepOutput, StepPrograms, StepShape
from kvjax.models.model import Model

TP_AXIS = "tp"
DP_AXIS = "dp"

# Layer tensors by name: the PartitionSpec of their [L, ...] array. Others are replicated.
_LAYER_SPECS = {
    "wq": P(None, None, TP_AXIS),
    "wk": P(None, None, TP_AXIS),
    "wv": P(None, None, TP_AXIS),
    "bq": P(None, TP_AXIS),
    "bk": P(None, TP_AXIS),
    "bv": P(None, TP_AXIS),
    "wo": P(None, TP_AXIS, None),
    "w_gate": P(None, None, TP_AXIS),
    "w_up": P(None, None, TP_AXIS),
    "w_down": P(None, TP_AXIS, None),
}
# Paged KV leaves are [L, num_pages, P, K, ...]; contiguous ones [L, B, S, K, D].
_KV_HEAD_AXIS = 3


def make_mesh(tp: int, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "tp") mesh over the first dp * tp of `devices` (default: all of jax.devices()).

    Devices of one tp group are adjacent in the list, so on a multi-process run a tp group spans
    processes only when tp exceeds the devices of one process.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("tp", tp), ("dp", dp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dp * tp > len(devices):
        raise ValueError(f"dp={dp} x tp={tp} needs {dp * tp} devices, only {len(devices)} exist")
    grid = np.asarray(devices[:dp * tp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP_AXIS, TP_AXIS))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ("tp",) mesh per dp replica of a ("dp", "tp") mesh: the devices of each engine."""
    if mesh.axis_names != (DP_AXIS, TP_AXIS):
        raise ValueError(f"expected a mesh with axes ('dp', 'tp'), got {mesh.axis_names}")
    return [Mesh(row, (TP_AXIS,)) for row in mesh.devices]


def tp_size(mesh: Mesh) -> int:
    """The size of the mesh's `tp` axis."""
    return int(mesh.shape[TP_AXIS])


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raises ValueError unless query heads, kv heads and F all split evenly over `tp`."""
    for name, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise ValueError(f"tensor parallelism tp={tp} does not divide {name}={value} of "
                             f"model {config.name!r}")


def check_engine_mesh(mesh: Mesh, config: ModelConfig) -> None:
    """Raises ValueError unless `mesh` is a valid single-replica tp mesh for `config`."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if TP_AXIS not in mesh.axis_names:
        raise ValueError(f"the engine's mesh needs a {TP_AXIS!r} axis, got {mesh.axis_names}")
    others = {name: size for name, size in mesh.shape.items() if name != TP_AXIS and size > 1}
    if others:
        raise ValueError(f"an engine runs one replica; mesh axes {others} must be 1 (give each "
                         f"replica its own engine: replica_meshes(mesh))")
    check_tensor_parallel(config, tp_size(mesh))


def param_specs(params: Any) -> Any:
    """The PartitionSpec of every params leaf (layer tensors by name, the rest replicated)."""
    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if len(names) == 2 and names[0] == "layers" and names[1] in _LAYER_SPECS:
            return _LAYER_SPECS[names[1]]
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def kv_specs(kv: Any, config: ModelConfig) -> Any:
    """The PartitionSpec of every KV leaf: the kv-head axis of page-major leaves is split.

    A leaf [L, num_pages, P, K, ...] (exact pages, quantized codes or per-head scales) splits
    on axis 3; leaves without a kv-head axis there are replicated.
    """
    def spec(leaf):
        if leaf.ndim > _KV_HEAD_AXIS and leaf.shape[_KV_HEAD_AXIS] == config.num_kv_heads:
            return P(*([None] * _KV_HEAD_AXIS), TP_AXIS)
        return P()

    return jax.tree.map(spec, kv)


def named(mesh: Mesh, specs: Any) -> Any:
    """NamedShardings on `mesh` for a pytree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def place(tree: Any, shardings: Any) -> Any:
    """Puts every leaf of `tree` at its sharding.

    Works in a multi-process run too: there every process passes the same full value and keeps
    only the shards of its own devices.
    """
    def put(x, sharding: NamedSharding):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # Already placed (e.g. the token feed a previous step returned).
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def shard_params(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """The params pytree laid out for tensor parallelism over mesh's `tp` axis."""
    check_tensor_parallel(config, tp_size(mesh))
    return place(params, named(mesh, param_specs(params)))


def shard_kernels(kernels: Callable, mesh: Mesh, config: ModelConfig) -> Callable:
    """A Pallas kernel chooser whose kernels run on each device over its own kv heads.

    A kernel is one opaque call that XLA cannot split, so each runs under `shard_map`: a
    device gets its K/tp kv heads of the KV state (`kv_specs`), the N/tp query heads that read
    them, and the replicated block tables and lengths, and returns its query heads' outputs,
    which stay split on the head axis as the model's q and output projections expect.

    Args:
      kernels: (kv, layer, window) -> (decode_fn, prefill_fn),
        `pallas_kernels.dispatch.kernels_for`.
      mesh: the engine's tp mesh.
      config: the model (which KV leaves carry a kv-head axis).
    """
    def sharded(kv: Any, layer: jax.Array, window: jax.Array | None = None):
        kv_spec = kv_specs(kv, config)
        windows = () if window is None else (window,)  # replicated, like the layer

        def run(index: int, q_spec: P, q: jax.Array, *tables: jax.Array) -> jax.Array:
            def local(kv, layer, *args):
                window, (q, *tables) = (args[0], args[1:]) if windows else (None, args)
                return kernels(kv, layer, window)[index](q, *tables)

            return jax.shard_map(
                local, mesh=mesh, out_specs=q_spec, check_vma=False,
                in_specs=(kv_spec, P(), *[P()] * len(windows), q_spec, *[P()] * len(tables)))(
                kv, layer, *windows, q, *tables)

        def decode(q, block_tables, kv_lens):  # q [B, N, D]
            return run(0, P(None, TP_AXIS, None), q, block_tables, kv_lens)

        def prefill(q, block_tables, kv_lens, q_lens):  # q [B, C, N, D]
            return run(1, P(None, None, TP_AXIS, None), q, block_tables, kv_lens, q_lens)

        return decode, prefill

    return sharded


class ShardedStepPrograms(StepPrograms):
    """Step programs that keep params and KV at their shardings across steps.

    Built from the engine's own programs, so the step computes exactly what it would (same
    model function and options); only the placement changes. The step's outputs (tokens,
    logprobs, logits) come back replicated; the returned KV state has the sharding of the
    donated one, so XLA updates it in place and the next step sees the same layout (no
    resharding, no recompile).
    """

    def __init__(self, programs: StepPrograms, mesh: Mesh, param_shardings: Any,
                 kv_shardings: Any) -> None:
        vars(self).update(vars(programs))
        self.mesh = mesh
        self.param_shardings = param_shardings
        self._replicated = NamedSharding(mesh, P())
        # XLA's matmuls: it splits them over the mesh (the native CPU matmul is one opaque
        # call over whole weights).
        step = functools.partial(programs._step.__wrapped__, place_kernels=functools.partial(
            shard_kernels, mesh=mesh, config=programs.config), matmul_impl=MatmulImpl.XLA)
        self._step = kvjax_jit.jit(step, static_argnames=("shape",), donate_argnames=("kv",),
                                   out_shardings=(self._replicated, kv_shardings),
                                   dtype=programs.dtype)
        self._copy = kvjax_jit.jit(programs._copy.__wrapped__, donate_argnums=0,
                             out_shardings=kv_shardings)

    def _replicate(self, host: Any) -> Any:
        return place(host, jax.tree.map(lambda _: self._replicated, host))

    def _placed_params(self, params: Any) -> Any:
        """Params at their shardings; new weights handed over unsharded are laid out here."""
        leaves = jax.tree.leaves(params)
        targets = jax.tree.leaves(self.param_shardings)
        if all(getattr(x, "sharding", None) == s for x, s in zip(leaves, targets, strict=True)):
            return params
        return place(params, self.param_shardings)

    def step(self, params: Any, kv: Any, host_input: dict[str, np.ndarray], shape: StepShape,
             host_kv: Any = None) -> tuple[StepOutput, Any]:
        """Dispatches one step; host inputs are replicated over the mesh first (a mesh has no
        host pool: `kvjax.engine.compat` refuses host-resident rows on one)."""
        if host_kv is not None:
            raise ValueError("host-resident rows do not run on a mesh")
        return super().step(self._placed_params(params), kv, self._replicate(host_input), shape)

    def copy_pages(self, kv: Any, src: np.ndarray, dst: np.ndarray) -> Any:
        return super().copy_pages(kv, *self._replicate((src, dst)))


def shard_model(model: Model, config: EngineConfig, mesh: Mesh) -> Model:
    """`model` with its params laid out over `mesh` (a tp mesh of one replica).

    Raises:
      ValueError: the mesh has no `tp` axis or other axes larger than 1, the head counts or F
        do not divide by tp, or a feature of `config` does not run on a mesh
        (kvjax.engine.compat).
    """
    check_engine_mesh(mesh, model.config)
    compat.check(config, on_mesh=True)
    return dataclasses.replace(model, params=shard_params(model.params, model.config, mesh))


def shard_kv_and_programs(kv: Any, programs: StepPrograms, model: Model, mesh: Mesh
                          ) -> tuple[Any, ShardedStepPrograms]:
    """The engine's KV state split over the kv-head axis, and step programs that keep it
    there."""
    kv_shardings = named(mesh, kv_specs(kv, model.config))
    param_shardings = named(mesh, param_specs(model.params))
    sharded = ShardedStepPrograms(programs, mesh, param_shardings, kv_shardings)
    return place(kv, kv_shardings), sharded
