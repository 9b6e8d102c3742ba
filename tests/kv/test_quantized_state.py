"""QuantizedPagedKV against the dequantized references of kvjax.kv.codecs.

Per-token codecs must read back codec.decode(codec.encode(x)) of each written token; KIVI
codecs must read back `kivi_roundtrip_reference` (residual 0) at every sequence length. Writes
come in engine-like steps: several sequences with randomly permuted pages, ragged chunks and
NaN-valued padding tokens at slot -1 that must write nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.kv import codecs, quantized

CONFIG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, name="state-test")
L, K, D = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim
PAGE_SIZE, NUM_PAGES = 8, 12
LAYER = 1  # Writes go to this layer; the other must stay untouched.
LENGTHS = (19, 8, 30)
# The state's jitted encode vs the eager reference encode of the same floats: identical codes,
# up to float32 rounding of the arithmetic around them.
ATOL = 1e-5

CODECS = [
        ("none", {}),
        ("int8", {}),
        ("int8", {"metadata_dtype": "float16"}),
        ("int4", {"group": 8}),
        ("int2", {"group": 4}),
        ("fp8_e4m3", {}),
        ("fp8_e5m2", {}),
        ("kivi4", {"group": 4}),
        ("kivi2", {"group": 8, "metadata_dtype": "float16"}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in CODECS]


@jax.jit
def _write(kv, layer, slots, k, v):
    return kv.write(layer, slots, k, v)


@jax.jit
def _load(kv, layer, pages):
    return kv.load_pages(layer, pages)


def _reference(codec, k_seq, v_seq, length):
    """What one sequence must read back after `length` tokens: [S, K, D] each."""
    if isinstance(codec, codecs.KiviCodec):
        return kivi_reference(codec, k_seq, v_seq, length)
    return codec.decode(codec.encode(k_seq)), codec.decode(codec.encode(v_seq))


def kivi_reference(codec, k_seq, v_seq, length):
    assert codec.residual == 0
    return codecs.kivi_roundtrip_reference(k_seq, v_seq, length, codec)


def _schedule(rng, lengths):
    """Engine-like steps: each a list of (sequence, first position, count), count 0..9."""
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        rows = []
        for seq in rng.permutation(len(lengths)):
            count = min(int(rng.choice([0, 1, 1, 3, 4, 9])), lengths[seq] - done[seq])
            if count:
                rows.append((int(seq), done[seq], count))
                done[seq] += count
        steps.append(rows)
    return steps


def _step_arrays(rng, rows, block_tables, k_all, v_all):
    """Slots [T] and K, V [T, K, D] of one step, with NaN padding tokens at slot -1."""
    slots, ks, vs = [], [], []
    pad = np.full((1, K, D), np.nan, np.float32)
    for seq, start, count in rows:
        for _ in range(int(rng.integers(0, 2))):
            slots.append(-1)
            ks.append(pad)
            vs.append(pad)
        positions = np.arange(start, start + count)
        slots += list(block_tables[seq, positions // PAGE_SIZE] * PAGE_SIZE
                      + positions % PAGE_SIZE)
        ks.append(k_all[seq, positions])
        vs.append(v_all[seq, positions])
    slots.append(-1)
    ks.append(pad)
    vs.append(pad)
    return (jnp.asarray(slots, jnp.int32), jnp.asarray(np.concatenate(ks)),
            jnp.asarray(np.concatenate(vs)))


def _setup(seed):
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-max(LENGTHS) // PAGE_SIZE)
    perm = rng.permutation(NUM_PAGES)
    block_tables = np.zeros((len(LENGTHS), pages_per_seq), np.int32)
    used = 0
    for seq, length in enumerate(LENGTHS):
        n = -(-length // PAGE_SIZE)
        block_tables[seq, :n] = perm[used:used + n]
        block_tables[seq, n:] = perm[0]  # Past the length: any valid page, masked by length.
        used += n
    total = pages_per_seq * PAGE_SIZE
    k_all = (rng.standard_normal((len(LENGTHS), total, K, D)) * 2).astype(np.float32)
    v_all = rng.standard_normal((len(LENGTHS), total, K, D)).astype(np.float32)
    # One outlier channel, as real keys have, so per-channel and per-token codecs differ.
    k_all[..., 3] += 8.0
    return rng, block_tables, perm[used:], k_all, v_all


def _read(kv, layer, block_tables):
    k, v = _load(kv, jnp.int32(layer), jnp.asarray(block_tables))  # [B, n, P, K, D]
    b, n = block_tables.shape
    return (np.asarray(k).reshape(b, n * PAGE_SIZE, K, D),
            np.asarray(v).reshape(b, n * PAGE_SIZE, K, D))


@pytest.mark.parametrize("name,options", CODECS, ids=IDS)
def test_load_pages_equals_dequantized_reference(name, options):
    rng, block_tables, free_pages, k_all, v_all = _setup(seed=len(IDS) + len(name))
    opts = {**options, "page_size": PAGE_SIZE}
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name, **opts)
    codec = kv.codec
    written = [0] * len(LENGTHS)
    for rows in _schedule(rng, LENGTHS):
        slots, k, v = _step_arrays(rng, rows, block_tables, k_all, v_all)
        kv = _write(kv, jnp.int32(LAYER), slots, k, v)
        for seq, start, count in rows:
            written[seq] = start + count
        k_read, v_read = _read(kv, LAYER, block_tables)
        for seq, length in enumerate(written):
            k_ref, v_ref = _reference(codec, k_all[seq], v_all[seq], length)
            np.testing.assert_allclose(k_read[seq, :length], np.asarray(k_ref)[:length],
                                       atol=ATOL, rtol=0, err_msg=f"K of seq {seq} at {length}")
            np.testing.assert_allclose(v_read[seq, :length], np.asarray(v_ref)[:length],
                                       atol=ATOL, rtol=0, err_msg=f"V of seq {seq} at {length}")
    for leaf in jax.tree.leaves(kv):
        leaf = np.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.isfinite(leaf.astype(np.float32)).all(), "a padding token was written"
        assert not leaf[1 - LAYER].any(), "a write leaked into another layer"
        assert not leaf[:, free_pages].any(), "a write leaked into an unassigned page"


@pytest.mark.parametrize("name,options", CODECS, ids=IDS)
def test_quantized_pool_is_smaller_and_its_bytes_are_exact(name, options):
    opts = {**options, "page_size": PAGE_SIZE}
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name, **opts)
    per_token = quantized.kv_bytes_per_token(CONFIG, name, **opts)
    assert kv.nbytes() == NUM_PAGES * PAGE_SIZE * per_token
    meta = 2 if options.get("metadata_dtype") == "float16" else 4
    bits = {"int4": 4, "kivi4": 4, "int2": 2, "kivi2": 2}.get(name)
    if name == "none":
        expected = 2 * L * K * D * 4
    elif bits is None:  # int8 and fp8 (whose dynamic scale is float32 whatever the option)
        expected = 2 * L * K * (D + meta)
    else:
        expected = 2 * L * K * (D * bits / 8 + 2 * meta * D / options["group"])
    if name.startswith("kivi"):
        g = options["group"]
        expected += L * (2 * g * K * D * 4 + 4) / PAGE_SIZE  # float32 window and counter
    assert per_token == expected
    if name != "none" and not name.startswith("kivi"):
        assert per_token < CONFIG.kv_bytes_per_token(jnp.float32)


@pytest.mark.parametrize("name,options", [c for c in CODECS if c[0] in ("int4", "kivi4")],
                         ids=["int4", "kivi4"])
def test_copy_pages_copies_everything_a_page_reads(name, options):
    rng, block_tables, free_pages, k_all, v_all = _setup(seed=3)
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name, **options)
    lengths = (5, 8, 22)  # A partly filled page, a full page, an open KIVI group.
    slots, k, v = _step_arrays(rng, [(s, 0, n) for s, n in enumerate(lengths)], block_tables,
                               k_all, v_all)
    kv = _write(kv, jnp.int32(LAYER), slots, k, v)
    src = block_tables[2, :3]
    dst = free_pages[:3]
    copied = jax.jit(lambda kv, s, d: kv.copy_pages(s, d))(kv, jnp.asarray(src),
                                                           jnp.asarray(dst))
    before_k, before_v = _read(kv, LAYER, src[None])
    after_k, after_v = _read(copied, LAYER, dst[None])
    np.testing.assert_array_equal(after_k[0, :22], before_k[0, :22])
    np.testing.assert_array_equal(after_v[0, :22], before_v[0, :22])


def test_kivi_page_reused_by_a_new_sequence_reads_its_new_tokens_exactly():
    codec_options = {"group": 4}
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, "kivi4", **codec_options)
    rng = np.random.default_rng(7)
    old = rng.standard_normal((PAGE_SIZE, K, D)).astype(np.float32)
    new = rng.standard_normal((3, K, D)).astype(np.float32)
    page = 5
    layer = jnp.int32(LAYER)
    kv = _write(kv, layer, jnp.arange(PAGE_SIZE, dtype=jnp.int32) + page * PAGE_SIZE,
                jnp.asarray(old), jnp.asarray(old))
    # The page is freed (not scrubbed) and its first 3 offsets written by another sequence.
    kv = _write(kv, layer, jnp.arange(3, dtype=jnp.int32) + page * PAGE_SIZE,
                jnp.asarray(new), jnp.asarray(new))
    k_read, v_read = _read(kv, LAYER, np.array([[page]]))
    np.testing.assert_array_equal(k_read[0, :3], new)  # An open group: read exactly.
    np.testing.assert_array_equal(v_read[0, :3], new)


def test_invalid_options_name_the_offending_value():
    with pytest.raises(ValueError, match="residual=128"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "kivi4", group=4, residual=128)
    with pytest.raises(ValueError, match="'calibrated'"):
        quantized.kv_bytes_per_token(CONFIG, "fp8_e4m3", scaling="calibrated")
    with pytest.raises(ValueError, match="page_size=6"):
        quantized.init_quantized_kv(CONFIG, 4, 6, "kivi2", group=4)
    with pytest.raises(ValueError, match="needs page_size"):
        quantized.kv_bytes_per_token(CONFIG, "kivi2", group=4)
    with pytest.raises(ValueError, match="page_size=16"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "kivi2", group=4, page_size=16)
    with pytest.raises(ValueError, match="num_pages"):
        quantized.init_quantized_kv(CONFIG, 0, PAGE_SIZE, "int8")
    with pytest.raises(ValueError, match="head_dim=16"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "int4")  # group 32 > D
    with pytest.raises(ValueError, match="unknown codec"):
        quantized.kv_bytes_per_token(CONFIG, "int3")
