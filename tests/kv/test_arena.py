"""An arena view stores and reads exactly what the pages of the same codec do.

The oracle for each codec is the engine's own state for it (PagedKV for exact float K/V,
QuantizedPagedKV for per-token codes and scales): the same writes, then every page read back,
must be bit-identical, with unwritten frames and dropped slots (-1) untouched.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv import arena, quantized
from kvjax.kv.state import init_paged_kv
from kvjax.testing import TINY

CODECS = [("none", jnp.float32, {}), ("none", jnp.bfloat16, {}), ("int8", None, {}),
          ("int4", None, {"group": 8}), ("fp8_e4m3", None, {})]


def _states(codec_name, dtype, options, num_frames=6):
    k_codec, v_codec = arena.arena_codecs(TINY, dtype or jnp.float32, codec_name, **options)
    layout = arena.frame_layout(TINY, k_codec, v_codec, 600)
    page_size = layout.page_size
    kv = arena.ArenaKV(arena.init_arena(num_frames, 600), layout, k_codec, v_codec)
    if codec_name == "none":
        ref = init_paged_kv(TINY, num_frames, page_size, dtype)
    else:
        ref = quantized.init_quantized_kv(TINY, num_frames, page_size, codec_name, **options)
    return kv, ref


@pytest.mark.parametrize("codec_name,dtype,options", CODECS, ids=[
    "f32", "bf16", "int8", "int4", "fp8"])
def test_arena_pages_equal_the_codecs_own_pages(codec_name, dtype, options):
    kv, ref = _states(codec_name, dtype, options)
    rng = np.random.default_rng(0)
    slots = rng.choice(kv.num_slots, 9, replace=False).astype(np.int32)
    slots[3] = -1
    for layer in range(TINY.num_layers):
        k = jnp.asarray(rng.normal(size=(9, TINY.num_kv_heads, TINY.head_dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(9, TINY.num_kv_heads, TINY.head_dim)), jnp.float32)
        kv = kv.write(jnp.int32(layer), jnp.asarray(slots), k, v)
        ref = ref.write(jnp.int32(layer), jnp.asarray(slots), k, v)
    pages = jnp.asarray(rng.permutation(kv.num_pages)[None], jnp.int32)  # [1, F]
    for layer in range(TINY.num_layers):
        for got, want in zip(kv.load_pages(jnp.int32(layer), pages),
                             ref.load_pages(jnp.int32(layer), pages), strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32))
    # Copy-on-write and the page-leaf round trip (swap, tiers, snapshots) keep every page.
    copied = kv.copy_pages(jnp.array([0, 1]), jnp.array([4, 5]))
    np.testing.assert_array_equal(copied.load_pages(1, jnp.array([[4, 5]]))[0],
                                  kv.load_pages(1, jnp.array([[0, 1]]))[0])
    round_trip = kv.with_page_leaves(kv.page_leaves())
    np.testing.assert_array_equal(round_trip.arena, kv.arena)
    assert kv.page_leaves()[0].shape[:2] == (TINY.num_layers, kv.num_pages)


def test_models_of_other_shapes_share_frames_without_touching_each_other():
    import dataclasses

    other = dataclasses.replace(TINY, num_layers=3, num_kv_heads=1)
    buffer = arena.init_arena(4, 600)
    views = []
    for config in (TINY, other):
        codec, _ = arena.arena_codecs(config, jnp.float32, "none")
        views.append(arena.ArenaKV(buffer, arena.frame_layout(config, codec, codec, 600), codec,
                                   codec))
    a, b = views
    assert a.page_size != b.page_size  # tokens per frame follow bytes per token
    x = jnp.ones((a.page_size, TINY.num_kv_heads, TINY.head_dim))
    a = a.write(jnp.int32(1), jnp.arange(a.page_size), x, -x)  # model a's frame 0
    b = b.replace(arena=a.arena)
    y = jnp.full((b.page_size, 1, TINY.head_dim), 3.0)
    b = b.write(jnp.int32(2), b.page_size + jnp.arange(b.page_size), y, y)  # b's frame 1
    a = a.replace(arena=b.arena)
    k, v = a.load_pages(jnp.int32(1), jnp.array([[0]]))
    np.testing.assert_array_equal(k, 1.0)
    np.testing.assert_array_equal(v, -1.0)
    assert not np.asarray(b.arena[0, a.layout.used_words:]).any()


def test_a_codec_that_shares_scales_across_tokens_is_refused():
    codec = quantized.make_codec("kivi4", group=4)
    with pytest.raises(ValueError, match="per channel group"):
        arena.frame_layout(TINY, codec, codec, 600)
