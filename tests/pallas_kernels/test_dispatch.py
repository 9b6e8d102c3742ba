"""The engine's Pallas dispatch over KV states: float pages, quantized pools, Quest selections.

Each state is built and written the way the engine's step writes it (`write` with a slot
mapping), and the kernels' result is compared with the engine's jnp path over the same state
(`paged_attention_blockwise` over `load_pages`, which dequantizes).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_cases import INTERPRET, TOLERANCES

from kvjax.config import ModelConfig
from kvjax.kv import attention as attention_ref
from kvjax.kv import quest
from kvjax.kv.quantized import init_quantized_kv
from kvjax.kv.state import init_paged_kv
from pallas_kernels import dispatch

CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64)
PAGE_SIZE = 4
KV_LENS = [1, 11, 0, 8, 19]


def filled(kv, seed: int):
    """Writes KV_LENS tokens per row into `kv` (both layers) through permuted block tables."""
    rng = np.random.default_rng(seed)
    pmax = -(-max(KV_LENS) // PAGE_SIZE)
    block_tables = rng.permutation(kv.num_pages)[:len(KV_LENS) * pmax].reshape(-1, pmax)
    slots = np.array([block_tables[row, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE
                      for row, length in enumerate(KV_LENS) for t in range(length)])
    shape = (len(slots), CONFIG.num_kv_heads, CONFIG.head_dim)
    for layer in range(CONFIG.num_layers):
        k, v = rng.standard_normal(shape), rng.standard_normal(shape)
        kv = kv.write(jnp.int32(layer), jnp.asarray(slots, jnp.int32),
                      jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
    return kv, jnp.asarray(block_tables, jnp.int32), jnp.asarray(KV_LENS, jnp.int32)


def engine_decode(kv, layer, q, block_tables, kv_lens, soft_cap=None):
    """The engine's jnp decode over any state: blockwise attention over its loaded pages."""
    width = -(-block_tables.shape[1] // 8) * 8
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))
    out = attention_ref.paged_attention_blockwise(
        q[:, None], lambda pages: kv.load_pages(layer, pages), tables, kv_lens,
        jnp.minimum(kv_lens, 1), pages_per_block=8, soft_cap=soft_cap)
    return out[:, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name", ["none", "int8", "fp8_e4m3", "int4", "int8-g32"])
def test_decode_matches_the_engine_path(codec_name):
    check_decode_and_prefill(codec_name, soft_cap=None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name", ["none", "int8"])
def test_soft_cap_reaches_the_kernels(codec_name):
    """Gemma 2's attention logit soft cap: the kernels (and the quantized prefill fallback)
    give the engine's capped jnp path."""
    check_decode_and_prefill(codec_name, soft_cap=1.0)


# Codec options by test name: int8 with a scale and zero per 32 channels.
CODEC_OPTIONS = {"int8-g32": ("int8", {"group": 32})}


def check_decode_and_prefill(codec_name, soft_cap):
    name, options = CODEC_OPTIONS.get(codec_name, (codec_name, {}))
    pool = (init_paged_kv(CONFIG, 32, PAGE_SIZE) if codec_name == "none"
            else init_quantized_kv(CONFIG, 32, PAGE_SIZE, name, **options))
    kv, block_tables, kv_lens = filled(pool, 1)
    q = jax.random.normal(jax.random.PRNGKey(2), (len(KV_LENS), CONFIG.num_heads,
                                                  CONFIG.head_dim), jnp.float32)
    layer = jnp.int32(1)
    decode_fn, prefill_fn = dispatch.layer_attention_fns(kv, layer, soft_cap=soft_cap)
    want = engine_decode(kv, layer, q, block_tables, kv_lens, soft_cap)
    np.testing.assert_allclose(decode_fn(q, block_tables, kv_lens), want,
                               **TOLERANCES[jnp.float32])
    chunk = prefill_fn(q[:, None], block_tables, kv_lens, jnp.minimum(kv_lens, 1))
    np.testing.assert_allclose(chunk[:, 0], want, **TOLERANCES[jnp.float32])


def test_refuses_states_no_kernel_reads():
    kivi = init_quantized_kv(CONFIG, 8, 32, "kivi4", group=32)
    with pytest.raises(ValueError, match="KIVI"):
        dispatch.layer_attention_fns(kivi, jnp.int32(0))
    calibrated_fp8 = init_quantized_kv(CONFIG, 8, 32, "fp8_e4m3", scaling="calibrated",
                                       scale=(1.0, 1.0))
    assert "dynamic" in dispatch.unsupported_reason(calibrated_fp8)
    with pytest.raises(ValueError, match="no kernel"):
        dispatch.layer_attention_fns(object(), jnp.int32(0))


@pytest.mark.timeout(120)
def test_quest_sparse_decode_equals_narrowed_dense_decode():
    kv, block_tables, kv_lens = filled(quest.init_quest_kv(init_paged_kv(CONFIG, 32,
                                                                          PAGE_SIZE)), 3)
    q = jax.random.normal(jax.random.PRNGKey(4), (len(KV_LENS), CONFIG.num_heads,
                                                  CONFIG.head_dim), jnp.float32)
    layer = jnp.int32(0)
    got = dispatch.quest_sparse_decode(kv, layer, q, block_tables, kv_lens, num_read=2)
    tables, lens = quest.narrow_decode_rows(kv, layer, q, block_tables, kv_lens, 2)
    k_pages, v_pages = kv.layer_pages(layer)
    want = attention_ref.paged_decode_attention_reference(q, k_pages, v_pages, tables, lens)
    np.testing.assert_allclose(got, want, **TOLERANCES[jnp.float32])
    decode_fn, _ = dispatch.layer_attention_fns(kv, layer)  # Quest's narrowed-table path
    np.testing.assert_allclose(decode_fn(q, tables, lens), want, **TOLERANCES[jnp.float32])


def test_dispatch_functions_have_the_reference_signatures():
    """The engine calls them positionally and by the reference's keywords."""
    decode_fn, prefill_fn = dispatch.attention_fns()
    assert (inspect.signature(decode_fn)
            == inspect.signature(attention_ref.paged_decode_attention_reference))
    assert (inspect.signature(prefill_fn)
            == inspect.signature(attention_ref.paged_prefill_attention_reference))
    assert INTERPRET == (jax.default_backend() == "cpu")
