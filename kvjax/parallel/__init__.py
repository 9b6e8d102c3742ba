"""Scale-out: tensor-parallel sharding over a mesh, and multi-process runs."""

from kvjax.parallel.sharding import (
    DP_AXIS,
    TP_AXIS,
    ShardedStepPrograms,
    check_tensor_parallel,
    kv_specs,
    make_mesh,
    param_specs,
    replica_meshes,
    shard_params,
)

__all__ = [
    "DP_AXIS",
    "TP_AXIS",
    "ShardedStepPrograms",
    "check_tensor_parallel",
    "kv_specs",
    "make_mesh",
    "param_specs",
    "replica_meshes",
    "shard_params",
]
