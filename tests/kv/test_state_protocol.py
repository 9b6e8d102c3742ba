"""Every KV state variant implements `KVState`, and its pages move bit-exactly.

Swapping, tiers, snapshots and disaggregation move pages through `page_leaves` and
`with_page_leaves` (`kvjax.kv.pages`), so a gather followed by a scatter must reproduce every
byte of every page leaf, for every variant.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import MlaConfig, ModelConfig
from kvjax.kv import mixed, quest
from kvjax.kv import pages as kv_pages
from kvjax.kv.quantized import init_quantized_kv
from kvjax.kv.state import KVState, LatentPagedKV, init_contiguous_kv, init_paged_kv

CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64)
NUM_PAGES = 8

VARIANTS = {
    "paged": lambda: init_paged_kv(CONFIG, NUM_PAGES, 4),
    "contiguous": lambda: init_contiguous_kv(CONFIG, 2, 16, page_size=4),
    "int8": lambda: init_quantized_kv(CONFIG, NUM_PAGES, 4, "int8"),
    "fp8_e4m3": lambda: init_quantized_kv(CONFIG, NUM_PAGES, 4, "fp8_e4m3"),
    "int4": lambda: init_quantized_kv(CONFIG, NUM_PAGES, 4, "int4"),
    "kivi4": lambda: init_quantized_kv(CONFIG, NUM_PAGES, 32, "kivi4", group=32,
                                       num_seq_slots=3),
    "quest_paged": lambda: quest.init_quest_kv(init_paged_kv(CONFIG, NUM_PAGES, 4)),
    "quest_int8": lambda: quest.init_quest_kv(init_quantized_kv(CONFIG, NUM_PAGES, 4, "int8")),
    "mixed_k8v4": lambda: mixed.init_mixed_kv(CONFIG, NUM_PAGES, 4, write_bits=(8, 4)),
}

# MLA: one latent row of d_c + d_r = 24 + 8 per token and layer.
MLA_CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=32,
                         mla=MlaConfig(kv_lora_rank=24, qk_nope_head_dim=8,
                                       qk_rope_head_dim=8, v_head_dim=8))
MOVABLE = {**VARIANTS, "latent": lambda: init_paged_kv(MLA_CONFIG, NUM_PAGES, 4)}


def _random_like(x, rng) -> jnp.ndarray:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.integers(0, 100, x.shape), x.dtype)


def _filled(kv, seed: int):
    """`kv` with random page leaves (each entry distinct enough to catch a misplaced page)."""
    rng = np.random.default_rng(seed)
    return kv.with_page_leaves([_random_like(x, rng) for x in kv.page_leaves()])


def _bytes(leaves) -> list[np.ndarray]:
    return [np.asarray(x).view(np.uint8) for x in leaves]


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_satisfies_the_protocol(name):
    kv = VARIANTS[name]()
    assert isinstance(kv, KVState)
    kv.check_ready()
    assert kv.num_pages == NUM_PAGES
    assert kv.num_slots == NUM_PAGES * kv.page_size
    assert isinstance(kv.codec_name, str)
    leaves = kv.page_leaves()
    assert leaves and all(x.shape[:2] == (CONFIG.num_layers, NUM_PAGES) for x in leaves)
    slot_leaves = kv.seq_slot_leaves()
    assert all(x.shape[:2] == (CONFIG.num_layers, kv.num_seq_slots) for x in slot_leaves)
    assert bool(slot_leaves) == (kv.num_seq_slots > 0) == kv.needs_rows
    k, v = kv.load_pages(jnp.int32(0), jnp.zeros((1, 2), jnp.int32))
    assert k.shape == v.shape == (1, 2, kv.page_size, CONFIG.num_kv_heads, CONFIG.head_dim)


@pytest.mark.parametrize("name", ["paged", "contiguous", "quest_paged"])
def test_exact_states_have_no_codec(name):
    assert VARIANTS[name]().codec_name == "none"


def test_quest_carries_its_base_codec():
    assert VARIANTS["quest_int8"]().codec_name == VARIANTS["int8"]().codec_name != "none"


def test_calibrated_fp8_is_not_ready_until_scaled():
    kv = init_quantized_kv(CONFIG, NUM_PAGES, 4, "fp8_e4m3", scaling="calibrated")
    with pytest.raises(ValueError, match="calibrate_kv"):
        kv.check_ready()
    with pytest.raises(ValueError, match="calibrate_kv"):
        quest.init_quest_kv(kv).check_ready()


@pytest.mark.parametrize("name", MOVABLE)
def test_gather_then_scatter_round_trips_bit_exactly(name):
    src = _filled(MOVABLE[name](), 0)
    pages = jnp.asarray([5, 2, 7], jnp.int32)
    blob = kv_pages.gather_pages(src, pages)
    assert [x.shape[1] for x in blob] == [3] * len(blob)
    dst_pages = jnp.asarray([0, 6, 3], jnp.int32)
    dst = kv_pages.scatter_pages(_filled(MOVABLE[name](), 1), dst_pages, blob)
    for got, want in zip(_bytes(kv_pages.gather_pages(dst, dst_pages)), _bytes(blob),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    # Pages outside the scatter keep the destination's own bytes.
    untouched = jnp.asarray([1, 4], jnp.int32)
    for got, want in zip(_bytes(kv_pages.gather_pages(dst, untouched)),
                         _bytes(kv_pages.gather_pages(_filled(MOVABLE[name](), 1), untouched)),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert [x.dtype for x in blob] == [x.dtype for x in src.page_leaves()]
    assert type(dst) is type(src)


@pytest.mark.parametrize("name", MOVABLE)
def test_zero_pages_zeroes_only_those_pages(name):
    kv = _filled(MOVABLE[name](), 2)
    scrubbed = kv_pages.zero_pages(kv, jnp.asarray([3, 1], jnp.int32))
    for before, after in zip(kv.page_leaves(), scrubbed.page_leaves(), strict=True):
        after = np.asarray(after)
        assert not after[:, [1, 3]].any()
        np.testing.assert_array_equal(after[:, [0, 2, 4]], np.asarray(before)[:, [0, 2, 4]])
    assert [x.shape for x in scrubbed.seq_slot_leaves()] == [
        x.shape for x in kv.seq_slot_leaves()]


@pytest.mark.parametrize("name", ["paged", "contiguous", "int8", "quest_paged"])
def test_slot_addressed_states_write_and_read_rows_by_slot(name):
    """States that need no rows write a step through its slot mapping, read through its tables."""
    kv = VARIANTS[name]()
    rng = np.random.default_rng(3)
    shape = (3, CONFIG.num_kv_heads, CONFIG.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    slots = jnp.asarray([5, -1, 9], jnp.int32)
    inp = types.SimpleNamespace(slot_mapping=slots)
    by_rows = kv.write_rows(jnp.int32(1), inp, None, k, v)
    by_slots = kv.write(jnp.int32(1), slots, k, v)
    for got, want in zip(_bytes(by_rows.page_leaves()), _bytes(by_slots.page_leaves()),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    tables = jnp.asarray([[2, 1], [0, 3]], jnp.int32)
    got_tables, load = by_rows.row_loader(jnp.int32(1), tables, jnp.asarray([5, 2], jnp.int32),
                                          jnp.zeros(2, jnp.int32))
    np.testing.assert_array_equal(got_tables, tables)
    for got, want in zip(load(tables), by_rows.load_pages(jnp.int32(1), tables), strict=True):
        np.testing.assert_array_equal(got, want)


def test_latent_pool_stores_one_row_read_as_keys_and_values():
    """An MLA pool holds one tensor of d_c + d_r per token (no values beside it): a written
    latent comes back as the keys and as the values, other slots stay zero, and the buffers
    are the spec's bytes."""
    kv = init_paged_kv(MLA_CONFIG, NUM_PAGES, 4)
    assert isinstance(kv, KVState) and isinstance(kv, LatentPagedKV)
    assert [x.shape for x in kv.page_leaves()] == [(2, NUM_PAGES, 4, 1, 32)]
    assert kv.nbytes() == NUM_PAGES * 4 * 2 * 32 * 4
    latent = jnp.asarray(np.random.default_rng(4).standard_normal((2, 1, 32)), jnp.float32)
    kv = kv.write(jnp.int32(1), jnp.asarray([6, -1], jnp.int32), latent, latent * 0 + 99)
    k, v = kv.load_pages(jnp.int32(1), jnp.asarray([[1]], jnp.int32))  # slots 4..7
    np.testing.assert_array_equal(np.asarray(k), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(k[0, 0, 2]), np.asarray(latent[0]))
    assert not np.asarray(k[0, 0, [0, 1, 3]]).any()
    assert not np.asarray(kv.load_pages(jnp.int32(0), jnp.asarray([[1]], jnp.int32))[0]).any()

