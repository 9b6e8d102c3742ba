"""The fused KV write's Pallas kernel, both schedules (TPU's and GPU's), against its jnp oracle
and the model's own key norm and RoPE, in interpret mode on the CPU.

Pools start as NaN, so a row written where it should not be, or not written, shows; slots are
a random permutation with padding (-1) among them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import llama
from kvjax.models.rope import RoPE, turn
from kvjax.testing import TINY
from pallas_kernels.fused_kv_write import fused_kv_write, fused_kv_write_reference
from pallas_kernels.fused_kv_write.kernel import Schedule

L, IN, K, D, PAGES, P, T = 2, 48, 2, 32, 5, 4, 6
SCHEDULES = pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)


def _case(seed: int, bias: bool, num_dropped: int):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    slots = rng.permutation(PAGES * P)[:T].astype(np.int32)
    slots[rng.permutation(T)[:num_dropped]] = -1
    cos, sin = RoPE(theta=1e4).tables(jnp.asarray(rng.integers(0, 300, T), jnp.int32), D)
    nan = jnp.full((L, PAGES, P, K, D), jnp.nan, jnp.float32)
    return (f32(T, IN), f32(L, IN, K * D), f32(L, IN, K * D), cos, sin, jnp.asarray(slots),
            nan, nan), dict(layer=1, pool_layer=0, bk=f32(K * D) if bias else None,
                            bv=f32(K * D) if bias else None)


@SCHEDULES
@pytest.mark.parametrize("bias,num_dropped", [(False, 2), (True, 0), (False, T)])
def test_kernel_writes_the_references_rows_and_nothing_else(bias, num_dropped, schedule):
    args, kw = _case(num_dropped, bias, num_dropped)
    got = jax.jit(lambda *a: fused_kv_write(*a, **kw, interpret=True, schedule=schedule))(*args)
    want = fused_kv_write_reference(*args, **kw)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert np.isfinite(g).sum() == (T - num_dropped) * K * D


@SCHEDULES
@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma"])
def test_k_norm_inside_the_kernel_is_the_models_key_norm(unit_offset, schedule):
    """Keys normalized per head before RoPE (qk_norm), against the model's own RMSNorm and
    RoPE over materialized keys (`kvjax.models.llama.norm`, `kvjax.models.rope.turn`)."""
    args, kw = _case(7, False, 1)
    x, wk, wv, cos, sin, slots = args[:6]
    weight = jnp.asarray(np.random.default_rng(8).normal(size=D), jnp.float32)
    config = dataclasses.replace(TINY, rms_norm_eps=1e-5, norm_unit_offset=unit_offset)
    got_k, got_v = jax.jit(lambda *a: fused_kv_write(
        *a, **kw, k_norm=weight, norm_eps=1e-5, norm_unit_offset=unit_offset,
        interpret=True, schedule=schedule))(*args)
    keys = llama.norm(config, (x @ wk[1]).reshape(T, K, D), weight)
    want_k = turn(keys, cos, sin)  # [T, K, D]
    want_v = (x @ wv[1]).reshape(T, K, D)
    written = np.asarray(slots) >= 0
    rows = np.asarray(slots)[written]
    for got, want in ((got_k, want_k), (got_v, want_v)):
        got = np.asarray(got)[0].reshape(PAGES * P, K, D)
        np.testing.assert_allclose(got[rows], np.asarray(want)[written], rtol=1e-5, atol=1e-5)
        assert np.isfinite(got).sum() == written.sum() * K * D
