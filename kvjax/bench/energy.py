"""An explicit, first-order energy model: an estimate, not a measurement.

    energy_j_est = flops * pj_per_flop
                 + sum over tiers of bytes_moved[tier] * pj_per_byte_<tier>
                 + idle_watts * duration_s

`pj_per_flop` is the dynamic energy of arithmetic, `pj_per_byte_*` the energy to move one
byte to or from a tier (device memory, host memory over the host link, disk), and
`idle_watts` the static power drawn for the whole run. The constants below are order-of-
magnitude estimates derived from public figures (cited beside each one); they are meant to
rank policies that trade FLOPs for bytes (recompute versus swap, quantized versus exact KV),
not to predict a power meter. Every result built from them is labelled an estimate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

_PJ = 1e-12  # joules per picojoule

TIERS = ("device", "host", "disk")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Estimated energy costs of one accelerator (or CPU) and its memory hierarchy.

    Attributes:
        name: the registry name.
        pj_per_flop: dynamic energy per floating-point operation, picojoules.
        pj_per_byte_device: per byte read or written in device memory (HBM; DRAM on a CPU).
        pj_per_byte_host: per byte moved between device and host memory (link and host DRAM).
        pj_per_byte_disk: per byte read from or written to local NVMe storage.
        idle_watts: static power drawn for the whole run, watts.
    """

    name: str
    pj_per_flop: float
    pj_per_byte_device: float
    pj_per_byte_host: float
    pj_per_byte_disk: float
    idle_watts: float

    def __post_init__(self):
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"HardwareProfile.{field.name} must be finite and >= 0, "
                                 f"got {value!r}")


# Sources of the orders of magnitude (all estimates):
#  - Arithmetic: board power over peak dense throughput. H100 and H200 SXM: 700 W TDP and
#    ~989 TFLOP/s dense BF16 (NVIDIA datasheets); taking ~100 W as static power leaves
#    ~600 W / 989e12 ~ 0.6 pJ/FLOP. TPU v5e: 197 TFLOP/s BF16 (Google Cloud documentation);
#    Google publishes no per-chip power, so ~200 W board power and ~50 W static are assumed,
#    giving ~0.75 pJ/FLOP. CPU: one AVX2 core at ~2.5 GHz peaks near 80 GFLOP/s FP32 (2 FMA
#    units x 8 lanes x 2) at roughly 8-12 W per core, so ~100 pJ/FLOP.
#  - Memory: Horowitz, "Computing's energy problem" (ISSCC 2014) lists ~1.3-2.6 nJ per 64-bit
#    DRAM access (20-40 pJ/bit) at 45 nm; O'Connor et al., "Fine-Grained DRAM" (MICRO 2017)
#    put HBM2 near 3.9 pJ/bit. HBM3/HBM3e and HBM2e are taken as ~3.5-4 pJ/bit, i.e. ~30
#    pJ/byte; DDR4/DDR5 behind a CPU as ~15 pJ/bit, i.e. ~120 pJ/byte.
#  - Host link: PCIe SerDes are in the 5-10 pJ/bit range; adding a host DRAM access gives
#    ~15-25 pJ/bit, ~150 pJ/byte.
#  - Disk: data-center NVMe drives draw ~10-25 W active at 7-14 GB/s sequential (vendor
#    datasheets), ~1-3.5 nJ/byte; 2 nJ/byte is used.
#  - Idle: nvidia-smi reports ~70-100 W for an idle H100/H200 SXM; the CPU profile charges
#    ~10 W for the share of a server that two virtual cores occupy.
PROFILES: dict[str, HardwareProfile] = {
    profile.name: profile for profile in (
        HardwareProfile("cpu", pj_per_flop=100.0, pj_per_byte_device=120.0,
                        pj_per_byte_host=120.0, pj_per_byte_disk=2000.0, idle_watts=10.0),
        HardwareProfile("h100", pj_per_flop=0.6, pj_per_byte_device=30.0,
                        pj_per_byte_host=150.0, pj_per_byte_disk=2000.0, idle_watts=100.0),
        HardwareProfile("h200", pj_per_flop=0.6, pj_per_byte_device=30.0,
                        pj_per_byte_host=150.0, pj_per_byte_disk=2000.0, idle_watts=100.0),
        HardwareProfile("tpu_v5e", pj_per_flop=0.75, pj_per_byte_device=32.0,
                        pj_per_byte_host=150.0, pj_per_byte_disk=2000.0, idle_watts=50.0),
    )
}


def get_profile(name: str) -> HardwareProfile:
    """The registered profile called `name`."""
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; expected one of {sorted(PROFILES)}")
    return PROFILES[name]


def estimate_energy_j(profile: HardwareProfile, flops: float, bytes_moved: Mapping[str, float],
                      duration_s: float) -> float:
    """Estimated energy of a run in joules (see the module docstring for the model).

    Args:
        profile: the hardware's estimated costs.
        flops: floating-point operations executed.
        bytes_moved: bytes per tier; keys are a subset of "device", "host", "disk".
        duration_s: wall-clock (or simulated) duration, charged at `idle_watts`.
    """
    unknown = sorted(set(bytes_moved) - set(TIERS))
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown} in bytes_moved; expected {TIERS}")
    for name, value in (("flops", flops), ("duration_s", duration_s), *bytes_moved.items()):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    per_byte = {"device": profile.pj_per_byte_device, "host": profile.pj_per_byte_host,
                "disk": profile.pj_per_byte_disk}
    dynamic_pj = flops * profile.pj_per_flop + sum(
        float(num_bytes) * per_byte[tier] for tier, num_bytes in bytes_moved.items())
    return dynamic_pj * _PJ + profile.idle_watts * duration_s
