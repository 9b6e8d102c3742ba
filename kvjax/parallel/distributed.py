"""Multi-process (multi-host) runs: every process drives the same engine over one global mesh.

JAX's multi-controller model: each process runs the same Python program, owns its local
devices, and calls every jitted function with the same arguments in the same order. An engine
is deterministic given its requests, so every process that feeds it the same requests makes
the same scheduling decisions, builds the same step inputs and dispatches the same steps; XLA
runs each step as one SPMD program over all processes' devices, with the collectives (the two
all-reduces per layer of tensor parallelism) crossing processes. Sampled tokens come back
replicated, so every process reads the same tokens.

On CPU the cross-process collectives go through gloo; on GPU (NCCL) and TPU (ICI/DCN) the
backend's own collectives are used and nothing here changes.
"""

from __future__ import annotations

import socket

import jax


def free_port() -> int:
    """A TCP port on localhost that is free now (for a local coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               initialization_timeout_s: int = 120) -> None:
    """Joins this process to a multi-process JAX run; call before any other JAX work.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: processes in the run.
      process_id: this process's index in [0, num_processes).
      initialization_timeout_s: how long to wait for every process to join.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    # Only the CPU backend reads this; GPU and TPU keep their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=initialization_timeout_s)
    # The first collective over a set of devices opens its cross-process context, and every
    # process must get there within a fixed 30 s. Open it here, where the processes are in
    # step, rather than at the first model step, which each process reaches after compiling
    # at its own pace.
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("kvjax.parallel.distributed.initialize")
