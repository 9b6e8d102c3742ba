"""Tests of the roofline helpers: step cost against a brute-force count over the params pytree,
the floor against hand-computed rates, and the measured rates against timing by hand."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.bench import roofline
from kvjax.config import ModelConfig
from kvjax.models import llama


def _config(**overrides) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8)
    return ModelConfig(**{**base, **overrides})


def _brute_force_matmul_weights(params, config: ModelConfig) -> int:
    """Every matrix (ndim >= 2 per layer) and bias a token is multiplied by or added through."""
    total = 0
    for name, leaf in params["layers"].items():
        if name.startswith(("w", "b")):
            total += leaf.size
    total += params["embed"].size if config.tie_word_embeddings else params["lm_head"].size
    return total


@pytest.mark.parametrize("tie,bias", [(True, False), (False, False), (False, True)])
def test_decode_step_cost_matches_a_count_over_the_params(tie, bias):
    config = _config(tie_word_embeddings=tie, qkv_bias=bias)
    params = llama.init_params(config, jax.random.key(0))
    kv_lens = [5, 17, 1]
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2  # 2-byte KV
    bytes_read, flops = roofline.decode_step_cost(config, params, len(kv_lens), sum(kv_lens),
                                                   kv_bytes_per_token=per_token)

    weights = _brute_force_matmul_weights(params, config)
    assert roofline.matmul_params(config) == weights
    attention = sum(2 * 2 * config.num_heads * config.head_dim * n for n in kv_lens) * 3
    assert flops == 2 * weights * len(kv_lens) + attention

    read = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    if not tie:  # Only the looked-up rows of an untied embedding are read.
        read -= params["embed"].nbytes - len(kv_lens) * config.hidden_size * 4
    kv = sum(kv_lens) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2
    assert bytes_read == read + kv


def test_step_floor_takes_the_slower_of_memory_and_compute():
    rates = roofline.MachineRates(memory_bytes_per_s=1e9, matmul_flops_per_s=1e10,
                                  memory_probe_bytes=1, matmul_size=1)
    memory_bound = roofline.step_floor(bytes_read=2e8, flops=1e9, rates=rates)
    assert memory_bound.floor_s == pytest.approx(0.2)
    assert memory_bound.bound == "memory"
    compute_bound = roofline.step_floor(bytes_read=1e6, flops=5e9, rates=rates)
    assert compute_bound.floor_s == pytest.approx(0.5)
    assert compute_bound.bound == "compute"
    with pytest.raises(ValueError, match="bytes_read=-1"):
        roofline.step_floor(bytes_read=-1, flops=0, rates=rates)


def test_measured_rates_are_not_faster_than_a_timed_run_allows():
    """A rate is work / best time, so one more timed run can be at most as fast as it says."""
    n = 256
    rate = roofline.measure_matmul_rate(n, repeats=3)
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, a))
    # Generous slack: the machine is shared, but a rate off by 10x means the FLOP count is wrong.
    assert 2 * n**3 / (time.perf_counter() - start) < 10 * rate
    bandwidth = roofline.measure_memory_bandwidth(8 << 20, repeats=3)
    x = jnp.ones((2 << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    start = time.perf_counter()
    assert float(total(x)) == np.float32(x.size)
    assert x.nbytes / (time.perf_counter() - start) < 10 * bandwidth
    with pytest.raises(ValueError, match="repeats"):
        roofline.measure_matmul_rate(8, repeats=0)
