"""The fused KV write's Pallas kernel against its jnp oracle, in interpret mode on the CPU.

Pools start as NaN, so a row written where it should not be, or not written, shows; slots are
a random permutation with padding (-1) among them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.rope import RoPE
from pallas_kernels.fused_kv_write import fused_kv_write, fused_kv_write_reference

L, IN, K, D, PAGES, P, T = 2, 24, 2, 8, 5, 4, 6


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


@pytest.mark.parametrize("bias,num_dropped", [(False, 2), (True, 0), (False, T)])
def test_kernel_writes_the_references_rows_and_nothing_else(bias, num_dropped):
    args, kw = _case(num_dropped, bias, num_dropped)
    got = jax.jit(lambda *a: fused_kv_write(*a, **kw, interpret=True))(*args)
    want = fused_kv_write_reference(*args, **kw)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert np.isfinite(g).sum() == (T - num_dropped) * K * D
