"""The machine's memory bandwidth and matmul rate, and the roofline floor of a decode step.

A decode step reads every weight once and every live token's K/V once per layer, and does about
two FLOPs per weight per sequence; it can be no faster than the slower of the two:

  floor = max(bytes read / memory bandwidth, FLOPs / matmul rate)

Both rates are measured here with XLA on the default backend (best of several runs, so a
shared machine's noise pulls them down less), which makes the floor a measured, not a quoted,
bound: what this machine did on the same compiler for a plain reduction and a plain matmul.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """Measured rates of this machine.

    Attributes:
      memory_bytes_per_s: read bandwidth of a float32 sum over an array much larger than cache.
      matmul_flops_per_s: FLOP rate of a float32 square matmul.
      memory_probe_bytes: size of the array the bandwidth was measured on.
      matmul_size: n of the n x n x n matmul the rate was measured on.
    """

    memory_bytes_per_s: float
    matmul_flops_per_s: float
    memory_probe_bytes: int
    matmul_size: int


@dataclasses.dataclass(frozen=True)
class StepFloor:
    """The roofline floor of one step.

    Attributes:
      bytes_read: weight bytes + KV bytes the step must read.
      flops: floating-point operations of the step.
      memory_s: bytes_read / bandwidth.
      compute_s: flops / matmul rate.
    """

    bytes_read: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def floor_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        """'memory' or 'compute': which term sets the floor."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


def best_time_s(fn: Callable[[], jax.Array], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call (compilation)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(num_bytes: int = 512 << 20, *, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a jitted float32 sum over `num_bytes` (best of `repeats`)."""
    if num_bytes < 4 or repeats < 1:
        raise ValueError(f"need num_bytes >= 4 and repeats >= 1, got {num_bytes}, {repeats}")
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / best_time_s(lambda: total(x), repeats)


def measure_matmul_rate(n: int = 1024, *, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of a jitted [n, n] @ [n, n] matmul of `dtype` operands summed in float32, as
    the model's matmuls are (2 n^3 FLOPs; best of `repeats`)."""
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1, got {n}, {repeats}")
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    return 2.0 * n**3 / best_time_s(lambda: matmul(a, b), repeats)


def measure_machine(memory_probe_bytes: int = 512 << 20, matmul_size: int = 1024, *,
                    repeats: int = 5) -> MachineRates:
    """Both rates of this machine (see the module docstring)."""
    return MachineRates(
        memory_bytes_per_s=measure_memory_bandwidth(memory_probe_bytes, repeats=repeats),
        matmul_flops_per_s=measure_matmul_rate(matmul_size, repeats=repeats),
        memory_probe_bytes=int(memory_probe_bytes), matmul_size=int(matmul_size))


def matmul_params(config: ModelConfig) -> int:
    """Weights a token multiplies by in one forward pass (projections, MLP, output head).

    The token embedding is a lookup, not a matmul, unless it doubles as the output head (tied).
    """
    c = config
    nd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (nd + 2 * kd) + nd * c.hidden_size + \
        3 * c.hidden_size * c.intermediate_size
    bias = (nd + 2 * kd) if c.qkv_bias else 0
    return c.num_layers * (per_layer + bias) + c.hidden_size * c.vocab_size


def decode_step_cost(config: ModelConfig, params, batch: int, kv_tokens: int,
                     kv_bytes_per_token: float) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` sequences holding `kv_tokens` in all.

    Bytes: every parameter once (the embedding table once whether tied or not: as the output
    head it is read whole; untied, only B rows of it are gathered and the output head is read
    whole instead) plus K and V of every live token in every layer. FLOPs: 2 per matmul weight
    per sequence, plus 4 * N * D per live token per layer for Q.K and P.V.

    Args:
      config: the model's architecture.
      params: the params pytree (its leaves' nbytes are summed).
      batch: B, sequences decoding one token each.
      kv_tokens: tokens in the caches of all B sequences together during the step (including
        the one each writes).
      kv_bytes_per_token: bytes one cached token takes in all layers, K and V (codes and
        metadata for a quantized cache: `Engine.kv_bytes_per_token`).
    """
    if batch < 1 or kv_tokens < 0:
        raise ValueError(f"need batch >= 1 and kv_tokens >= 0, got {batch}, {kv_tokens}")
    c = config
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    if not c.tie_word_embeddings:
        embed = params["embed"]
        weight_bytes -= embed.nbytes - batch * c.hidden_size * embed.dtype.itemsize
    kv_bytes = kv_tokens * kv_bytes_per_token
    return float(weight_bytes + kv_bytes), decode_step_flops(c, batch, kv_tokens)


def decode_step_flops(config: ModelConfig, batch: int, kv_tokens: int) -> float:
    """FLOPs of one decode step (`decode_step_cost`): 2 per matmul weight per sequence, plus
    4 * N * D per live token per layer for Q.K and P.V."""
    c = config
    return 2.0 * matmul_params(c) * batch + \
        4.0 * c.num_heads * c.head_dim * kv_tokens * c.num_layers


def step_floor(bytes_read: float, flops: float, rates: MachineRates) -> StepFloor:
    """The roofline floor of a step that reads `bytes_read` and does `flops`."""
    if bytes_read < 0 or flops < 0:
        raise ValueError(f"bytes_read={bytes_read} and flops={flops} must be >= 0")
    return StepFloor(bytes_read=float(bytes_read), flops=float(flops),
                     memory_s=bytes_read / rates.memory_bytes_per_s,
                     compute_s=flops / rates.matmul_flops_per_s)
