"""The fused KV write (`kvjax.kv.fused_write`): the native kernel against the jnp write that
materializes K and V and scatters them, on random weights and a random pool.

Written rows equal the reference's (and bitwise the batch-invariant matmul's, turned by the
same RoPE tables); every other row of the pool keeps its bits, dropped slots (-1) included.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv import fused_write
from kvjax.kv.state import PagedKV
from kvjax.models import linear, llama
from kvjax.models.rope import RoPE, turn
from kvjax.testing import TINY

pytestmark = pytest.mark.skipif(linear.kv_write_unavailable_reason() is not None,
                                reason=str(linear.kv_write_unavailable_reason()))

L, IN, K, D, PAGES, P, T = 3, 40, 2, 16, 6, 4, 7


def _case(seed: int, bias: bool):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    slots = rng.permutation(PAGES * P)[:T].astype(np.int32)
    slots[2] = -1  # a padding token: written nowhere
    positions = jnp.asarray(rng.integers(0, 500, T), jnp.int32)
    cos, sin = RoPE(theta=1e4).tables(positions, D)
    kv = PagedKV(k_pages=f32(L, PAGES, P, K, D), v_pages=f32(L, PAGES, P, K, D))
    return dict(kv=kv, slots=jnp.asarray(slots), x=f32(T, IN), wk=f32(L, IN, K * D),
                wv=f32(L, IN, K * D), bk=f32(K * D) if bias else None,
                bv=f32(K * D) if bias else None, cos=cos, sin=sin)


def _write(case, pool_layer, layer, fn=fused_write.write_projected, **kw):
    c = dict(case)
    kv = c.pop("kv")
    args = (jnp.int32(pool_layer), c["slots"], c["x"], c["wk"], c["wv"], jnp.int32(layer),
            c["bk"], c["bv"], c["cos"], c["sin"])
    return jax.jit(lambda kv, *a: fn(kv, *a, **kw))(kv, *args)


@pytest.mark.parametrize("bias", [False, True])
def test_native_write_equals_materialize_then_scatter(bias):
    case = _case(0, bias)
    before = jax.tree.map(np.asarray, case["kv"])
    got = _write(case, pool_layer=2, layer=1)
    want = _write(case, pool_layer=2, layer=1, fn=fused_write.write_projected_reference)
    for name in ("k_pages", "v_pages"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        flat = g.reshape(L, PAGES * P, K, D)
        written = np.zeros((L, PAGES * P), bool)
        written[2, [s for s in np.asarray(case["slots"]) if s >= 0]] = True
        # Rows not written keep their bits; written ones changed.
        np.testing.assert_array_equal(
            flat[~written], getattr(before, name).reshape(L, PAGES * P, K, D)[~written])
        assert not np.any(flat[written] == getattr(before, name).reshape(
            L, PAGES * P, K, D)[written])


def test_invariant_write_is_bitwise_the_invariant_matmul_turned_by_rope():
    """With `invariant`, the written K rows are bitwise RoPE (XLA's elementwise turn) of
    `invariant_linear`'s product, and V rows that product: the batch-invariant mode's K/V.
    XLA's turn is compiled at XLA's default optimization level (the one the engine runs at),
    whatever level the test session compiles at (`make test` compiles at level 0)."""
    case = _case(1, bias=False)
    got = _write(case, pool_layer=0, layer=2, invariant=True)
    slots = np.asarray(case["slots"])
    rows = slots >= 0
    for name, w in (("k_pages", case["wk"]), ("v_pages", case["wv"])):
        y = jax.jit(linear.invariant_linear)(case["x"], w, jnp.int32(2)).reshape(T, K, D)
        if name == "k_pages":
            args = (y, case["cos"], case["sin"])
            y = jax.jit(turn).lower(*args).compile(
                compiler_options={"xla_backend_optimization_level": 3})(*args)
        flat = np.asarray(getattr(got, name)).reshape(L, PAGES * P, K, D)
        np.testing.assert_array_equal(flat[0, slots[rows]], np.asarray(y)[rows])


def test_states_the_write_cannot_serve_say_why():
    kv = _case(2, bias=False)["kv"]
    assert fused_write.reason_for(kv) is None
    bf16 = PagedKV(k_pages=kv.k_pages.astype(jnp.bfloat16), v_pages=kv.v_pages.astype(
        jnp.bfloat16))
    assert "bfloat16" in fused_write.reason_for(bf16)
    assert "does not hold" in fused_write.reason_for(object())


@pytest.mark.parametrize("pallas", [False, True], ids=["native", "pallas"])
def test_key_norm_inside_the_write_is_the_models_norm_then_rope(pallas):
    """qk_norm (Qwen3): K = RoPE(norm(x @ wk + bk)) per head, against the model's own RMSNorm
    and RoPE over materialized keys; the Pallas kernel also takes the layer's weight slice."""
    case = _case(3, bias=True)
    weight = jnp.asarray(np.random.default_rng(4).normal(size=D), jnp.float32)
    layer = 1
    if pallas:  # a scan's slices: [In, K*D]
        case = dict(case, wk=case["wk"][layer], wv=case["wv"][layer])
    got = _write(case, pool_layer=0, layer=layer, k_norm=weight, norm_eps=1e-5,
                 pallas=pallas)
    wk = case["wk"] if pallas else case["wk"][layer]
    config = dataclasses.replace(TINY, rms_norm_eps=1e-5)
    keys = llama.norm(config, (case["x"] @ wk + case["bk"]).reshape(T, K, D), weight)
    want = np.asarray(turn(keys, case["cos"], case["sin"]))  # [T, K, D]
    slots = np.asarray(case["slots"])
    rows = slots >= 0
    flat = np.asarray(got.k_pages).reshape(L, PAGES * P, K, D)
    np.testing.assert_allclose(flat[0, slots[rows]], want[rows], rtol=1e-5, atol=1e-5)
