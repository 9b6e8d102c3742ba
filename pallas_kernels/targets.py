"""What the kernels are compiled for: the platform and, on GPU, the facts that size blocks.

The platform is the abstract mesh's device when one is set (a deviceless compile for a GPU or
TPU target traces under `jax.sharding.use_abstract_mesh` with that target's abstract device),
else the default backend. So the same kernel code picks its schedule, split count and block
sizes for the machine it will run on, whether or not that machine is present.

`GPU_SPECS` is the small per-target table the GPU (Triton) schedule sizes its blocks from:
the shared memory a block may opt into and the compute capability (fp8 conversions need
sm_89). Bandwidth and peak rates are the published figures, for predicted rooflines only.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model's published facts.

    Attributes:
      name: a short name (`H100`).
      compute_capability: (major, minor).
      shared_memory_per_block: bytes a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin).
      num_sms: streaming multiprocessors.
      hbm_bytes_per_s: device memory bandwidth.
      peak_flops: dense matmul FLOP/s by operand dtype name ("bfloat16", "float32").
    """

    name: str
    compute_capability: tuple[int, int]
    shared_memory_per_block: int
    num_sms: int
    hbm_bytes_per_s: float
    peak_flops: dict[str, float]


# Keys are matched as substrings of the device kind ("NVIDIA H100 80GB HBM3").
GPU_SPECS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", (9, 0), 232_448, 132, 3.35e12,
                    {"bfloat16": 989e12, "float32": 67e12}),
    "H200": GpuSpec("H200", (9, 0), 232_448, 132, 4.8e12,
                    {"bfloat16": 989e12, "float32": 67e12}),
    "A100": GpuSpec("A100", (8, 0), 166_912, 108, 2.039e12,
                    {"bfloat16": 312e12, "float32": 19.5e12}),
}
# An unknown GPU gets the smallest opt-in shared memory of current parts (sm_86 / sm_89:
# 99 KiB), so blocks fit wherever the compile lands.
_FALLBACK_SHARED_MEMORY = 101_376


def _abstract_device():
    return jax.sharding.get_abstract_mesh().abstract_device


def current_platform() -> str:
    """'gpu', 'tpu' or 'cpu': the abstract mesh's device platform if set, else the backend."""
    device = _abstract_device()
    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform


def _device_kind_and_capability() -> tuple[str, tuple[int, int] | None]:
    device = _abstract_device()
    if device is not None:
        return device.device_kind, None
    real = jax.devices()[0]
    capability = getattr(real, "compute_capability", None)
    if capability is None:
        return real.device_kind, None
    major, minor = str(capability).split(".")
    return real.device_kind, (int(major), int(minor))


def current_gpu() -> GpuSpec:
    """The spec of the GPU being compiled for (the abstract device's, else device 0's).

    A kind missing from GPU_SPECS keeps its own compute capability where the device reports
    one, with conservative shared memory (99 KiB) and no rates.
    """
    kind, capability = _device_kind_and_capability()
    for key, spec in GPU_SPECS.items():
        if key in kind:
            return spec
    return GpuSpec(kind, capability or (8, 0), _FALLBACK_SHARED_MEMORY,
                   getattr(jax.devices()[0], "core_count", 108), 0.0, {})


def fp8_unsupported_reason(spec: GpuSpec) -> str | None:
    """Why the GPU cannot run the fp8 kernel (float8 conversions need sm_89), or None."""
    if spec.compute_capability < (8, 9):
        major, minor = spec.compute_capability
        return (f"fp8 KV needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{spec.name} is sm_{major}{minor}")
    return None
