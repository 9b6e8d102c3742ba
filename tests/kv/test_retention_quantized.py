"""Compaction of quantized pages: a moved token keeps its exact codes and scales.

`move_slots` moves token rows of every page leaf, so a per-token codec's token decodes, after
the move, to bit-for-bit what it decoded to before, and no other slot changes. KIVI's key
scales cover groups of tokens: its tokens neither move nor rotate alone (its compaction
re-encodes groups: tests/kv/test_quantized_state.py). A per-token codec's rotated key is its
decoded key rotated and encoded again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv import quantized
from kvjax.kv.retention import move_slots, rotate_slots
from kvjax.testing import TINY

P = 4
NUM_PAGES = 3
# D = 8 in the tiny model: int4 and int2 scale groups of 4 channels, two groups per head.
CODECS = {"int8": {}, "int4": dict(group=4), "int2": dict(group=4), "fp8_e4m3": {}}


def filled_pool(codec_name: str, options: dict) -> quantized.QuantizedPagedKV:
    """A pool whose every slot of every layer holds a distinct random token."""
    kv = quantized.init_quantized_kv(TINY, NUM_PAGES, P, codec_name, **options)
    shape = (kv.num_slots, TINY.num_kv_heads, TINY.head_dim)
    slots = jnp.arange(kv.num_slots, dtype=jnp.int32)
    for layer in range(TINY.num_layers):
        k_key, v_key = jax.random.split(jax.random.PRNGKey(layer))
        # Per-token magnitudes differ, so every token has scales of its own.
        gain = jnp.exp(jax.random.normal(jax.random.PRNGKey(10 + layer), (shape[0], 1, 1)))
        kv = kv.write(jnp.int32(layer), slots, gain * jax.random.normal(k_key, shape),
                      gain * jax.random.normal(v_key, shape))
    return kv


def decoded(kv) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's K and V as the state decodes them, each [L, num_slots, K, D]."""
    pages = jnp.arange(kv.num_pages, dtype=jnp.int32)[None]  # [1, num_pages]
    out = []
    for layer in range(TINY.num_layers):
        k, v = kv.load_pages(jnp.int32(layer), pages)  # [1, num_pages, P, K, D]
        out.append((np.asarray(k).reshape(kv.num_slots, *k.shape[3:]),
                    np.asarray(v).reshape(kv.num_slots, *v.shape[3:])))
    return np.stack([k for k, _ in out]), np.stack([v for _, v in out])


def token_rows(kv) -> list[np.ndarray]:
    """Every page leaf as [L, num_slots, ...]: one row per token."""
    return [np.asarray(x).reshape(x.shape[0], -1, *x.shape[3:]) for x in kv.page_leaves()]


@pytest.mark.parametrize("codec_name", list(CODECS))
def test_moved_tokens_keep_their_codes_scales_and_decoded_values(codec_name):
    kv = filled_pool(codec_name, CODECS[codec_name])
    src = np.array([9, 0, 5, 11])  # across pages; dst 0 <- src 9 while slot 0 moves to 5
    dst = np.array([0, 5, 1, 6])
    rows_before, (k_before, v_before) = token_rows(kv), decoded(kv)
    moved = jax.jit(move_slots)(kv, jnp.asarray(src), jnp.asarray(dst))
    assert jax.tree.structure(moved) == jax.tree.structure(kv)
    rest = np.setdiff1d(np.arange(kv.num_slots), dst)
    for before, after in zip(rows_before, token_rows(moved), strict=True):
        np.testing.assert_array_equal(after[:, dst], before[:, src])  # codes, scales, zeros
        np.testing.assert_array_equal(after[:, rest], before[:, rest])
    k_after, v_after = decoded(moved)
    np.testing.assert_array_equal(k_after[:, dst], k_before[:, src])
    np.testing.assert_array_equal(v_after[:, dst], v_before[:, src])
    np.testing.assert_array_equal(k_after[:, rest], k_before[:, rest])
    np.testing.assert_array_equal(v_after[:, rest], v_before[:, rest])


def test_calibrated_fp8_scales_stay_in_the_codec_so_moves_keep_values():
    kv = quantized.init_quantized_kv(TINY, NUM_PAGES, P, "fp8_e4m3", scaling="calibrated")
    scales = np.full((TINY.num_layers, TINY.num_kv_heads), 0.01)
    kv = quantized.calibrate_fp8(kv, scales, 2 * scales)
    shape = (kv.num_slots, TINY.num_kv_heads, TINY.head_dim)
    slots = jnp.arange(kv.num_slots, dtype=jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    kv = kv.write(jnp.int32(0), slots, x, -x)
    (k_before, v_before), src, dst = decoded(kv), np.array([10, 3]), np.array([2, 7])
    k_after, v_after = decoded(move_slots(kv, jnp.asarray(src), jnp.asarray(dst)))
    np.testing.assert_array_equal(k_after[:, dst], k_before[:, src])
    np.testing.assert_array_equal(v_after[:, dst], v_before[:, src])


def test_kivi_tokens_do_not_move_or_rotate_alone():
    """KIVI compacts through `KVState.compact`, which re-encodes whole key groups; a lone
    token move or key rotation is refused."""
    kivi = quantized.init_quantized_kv(TINY, NUM_PAGES, P, "kivi4", group=4)
    with pytest.raises(ValueError, match="rows per page"):
        move_slots(kivi, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="group"):
        rotate_slots(kivi, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), 10000.0)


@pytest.mark.parametrize("codec_name", ["int8", "fp8_e4m3"])
def test_rotated_quantized_keys_are_the_rotation_of_their_decoded_keys(codec_name):
    """Oracle: RoPE's rotation by the shift of each slot's decoded key, encoded once more;
    values and the other slots keep their codes bit for bit."""
    kv = filled_pool(codec_name, CODECS[codec_name])
    slots, shifts = np.array([0, 1, 6, 9]), np.array([3, 3, 5, 40])
    rows_before, (k_before, v_before) = token_rows(kv), decoded(kv)
    rotated = rotate_slots(kv, jnp.asarray(slots), jnp.asarray(shifts), TINY.rope)
    rows_after, (k_after, v_after) = token_rows(rotated), decoded(rotated)
    want = np.stack([np.asarray(TINY.rope.rotate(jnp.asarray(k_before[layer, slots]),
                                                jnp.asarray(shifts)))
                     for layer in range(TINY.num_layers)])  # [L, M, K, D]
    # One more rounding: within a step of the codec's scale (int8: amax / 127 per head).
    step = np.abs(want).max(-1, keepdims=True) / (127 if codec_name == "int8" else 8)
    assert np.all(np.abs(k_after[:, slots] - want) <= step)
    others = np.setdiff1d(np.arange(kv.num_slots), slots)
    np.testing.assert_array_equal(k_after[:, others], k_before[:, others])
    np.testing.assert_array_equal(v_after, v_before)
    for before, after in zip(rows_before[2:], rows_after[2:], strict=True):  # value leaves
        np.testing.assert_array_equal(after, before)
