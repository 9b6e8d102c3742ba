"""QuantizedPagedKV against the dequantized references of kvjax.kv.codecs.

Per-token codecs must read back codec.decode(codec.encode(x)) of each written token; KIVI
codecs (with and without an exact residual window) must read back `kivi_roundtrip_reference`
at every sequence length, and their attention must equal dense attention over that round trip.
Writes come in engine-like steps: several sequences with randomly permuted pages, ragged chunks
and NaN-valued padding tokens (slot -1, or past a row's q_len) that must write nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.engine.step import StepInput, StepShape, empty_step_input
from kvjax.kv import codecs, quantized
from kvjax.kv.attention import dense_attention_reference, paged_attention_blockwise
from kvjax.testing import permuted_block_tables

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
]
KIVI = [
        ("kivi4", {"group": 4}),
        ("kivi4", {"group": 4, "residual": 8}),
        ("kivi2", {"group": 8, "residual": 4, "metadata_dtype": "float16"}),
]
NUM_SEQ_SLOTS = 4  # Window slots: sequence i writes slot SEQ_SLOTS[i]; the others stay zero.
SEQ_SLOTS = (2, 0, 3)


def _ids(cases):
    return [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in cases]


IDS = _ids(CODECS)


@jax.jit
def _write(kv, layer, slots, k, v):
    return kv.write(layer, slots, k, v)


@jax.jit
def _load(kv, layer, pages):
    return kv.load_pages(layer, pages)


def _reference(codec, k_seq, v_seq, length):
    """What one sequence must read back after `length` tokens: [S, K, D] each."""
    if isinstance(codec, codecs.KiviCodec):
        return codecs.kivi_roundtrip_reference(k_seq, v_seq, length, codec)
    return codec.decode(codec.encode(k_seq)), codec.decode(codec.encode(v_seq))


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
    block_tables, free_pages = permuted_block_tables(rng, LENGTHS, PAGE_SIZE, NUM_PAGES,
                                                     return_free=True)
    total = block_tables.shape[1] * PAGE_SIZE
    k_all = (rng.standard_normal((len(LENGTHS), total, K, D)) * 2).astype(np.float32)
    v_all = rng.standard_normal((len(LENGTHS), total, K, D)).astype(np.float32)
    # One outlier channel, as real keys have, so per-channel and per-token codecs differ.
    k_all[..., 3] += 8.0
    return rng, block_tables, free_pages, k_all, v_all


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


def _step_input(rng, rows, block_tables, k_all, v_all):
    """One engine-like step of KIVI writes: (StepInput, StepShape, K [T, K, D], V).

    Rows of one token are decode rows, the others prefill rows of at most 9 tokens packed
    back to back (one more row is pure padding); padding tokens are NaN.
    """
    decode = [r for r in rows if r[2] == 1]
    prefill = [r for r in rows if r[2] > 1] + [None]
    shape = StepShape(num_decode=len(decode), num_prefill=len(prefill), chunk=9 * len(prefill),
                      max_pages=block_tables.shape[1], row_chunk=9)
    buf = empty_step_input(shape)
    k = np.full((shape.num_tokens, K, D), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    next_prefill = len(decode)  # prefill rows are packed after the decode tokens
    for r, row in enumerate(decode + prefill):
        if row is None:
            continue
        seq, start, count = row
        t0 = r
        if r >= len(decode):
            t0, next_prefill = next_prefill, next_prefill + count
            buf["row_starts"][r] = t0
            buf["token_rows"][t0:] = r
        positions = np.arange(start, start + count)
        k[t0:t0 + count] = k_all[seq, positions]
        v[t0:t0 + count] = v_all[seq, positions]
        buf["slot_mapping"][t0:t0 + count] = (block_tables[seq, positions // PAGE_SIZE]
                                              * PAGE_SIZE + positions % PAGE_SIZE)
        buf["positions"][t0:t0 + count] = positions
        buf["block_tables"][r] = block_tables[seq]
        buf["kv_lens"][r] = start + count
        buf["q_lens"][r] = count
        buf["seq_slots"][r] = SEQ_SLOTS[seq]
    return StepInput(**buf), shape, jnp.asarray(k), jnp.asarray(v)


@jax.jit(static_argnames=("shape",))
def _write_rows(kv, layer, inp, k, v, *, shape):
    return kv.write_rows(layer, inp, shape, k, v)


@jax.jit
def _load_rows(kv, layer, block_tables, lengths, seq_slots):
    tables, load = kv.row_loader(layer, block_tables, lengths, seq_slots)
    return load(tables)  # [B, n, P, K, D] each


def _read_rows(kv, layer, block_tables, lengths):
    """Each sequence's K and V through `row_loader`: [B, n * P, K, D] each."""
    k, v = _load_rows(kv, jnp.int32(layer), jnp.asarray(block_tables),
                      jnp.asarray(lengths, jnp.int32), jnp.asarray(SEQ_SLOTS))
    b, n = block_tables.shape
    return (np.asarray(k).reshape(b, n * PAGE_SIZE, K, D),
            np.asarray(v).reshape(b, n * PAGE_SIZE, K, D))


def _write_kivi(name, options, seed):
    """Writes LENGTHS tokens in engine-like steps, checking every sequence after each step."""
    rng, block_tables, free_pages, k_all, v_all = _setup(seed)
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name,
                                     num_seq_slots=NUM_SEQ_SLOTS, **options)
    written = [0] * len(LENGTHS)
    for rows in _schedule(rng, LENGTHS):
        inp, shape, k, v = _step_input(rng, rows, block_tables, k_all, v_all)
        kv = _write_rows(kv, jnp.int32(LAYER), inp, k, v, shape=shape)
        for seq, start, count in rows:
            written[seq] = start + count
        k_read, v_read = _read_rows(kv, LAYER, block_tables, written)
        for seq, length in enumerate(written):
            k_ref, v_ref = _reference(kv.codec, k_all[seq], v_all[seq], length)
            np.testing.assert_allclose(k_read[seq, :length], np.asarray(k_ref)[:length],
                                       atol=ATOL, rtol=0, err_msg=f"K of seq {seq} at {length}")
            np.testing.assert_allclose(v_read[seq, :length], np.asarray(v_ref)[:length],
                                       atol=ATOL, rtol=0, err_msg=f"V of seq {seq} at {length}")
    return kv, block_tables, free_pages, k_all, v_all


@pytest.mark.parametrize("name,options", KIVI, ids=_ids(KIVI))
def test_kivi_rows_read_back_the_roundtrip_reference(name, options):
    kv, _, free_pages, _, _ = _write_kivi(name, options, seed=11)
    for leaf in jax.tree.leaves(kv):
        leaf = np.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.isfinite(leaf.astype(np.float32)).all(), "a padding token was written"
        assert not leaf[1 - LAYER].any(), "a write leaked into another layer"
    for leaf in jax.tree.leaves(kv.pages_only()):
        assert not np.asarray(leaf)[:, free_pages].any(), "a write leaked into a free page"
    unused = sorted(set(range(NUM_SEQ_SLOTS)) - set(SEQ_SLOTS))
    assert not np.asarray(kv.k_residual)[:, unused].any(), "a write leaked into a free slot"


@pytest.mark.parametrize("name,options", KIVI[1:], ids=_ids(KIVI[1:]))
def test_kivi_attention_equals_dense_attention_over_the_roundtrip(name, options):
    """The oracle: aged groups read quantized, the recent tokens exact (float32 math)."""
    kv, block_tables, _, k_all, v_all = _write_kivi(name, options, seed=5)
    rng = np.random.default_rng(9)
    num_heads = CONFIG.num_heads
    q = rng.standard_normal((len(LENGTHS), num_heads, D)).astype(np.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    tables, load = kv.row_loader(jnp.int32(LAYER), jnp.asarray(block_tables), lengths,
                                 jnp.asarray(SEQ_SLOTS))
    width = -(-block_tables.shape[1] // 2) * 2
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    got = paged_attention_blockwise(jnp.asarray(q)[:, None], load, tables, lengths,
                                    jnp.ones_like(lengths), pages_per_block=2)[:, 0]
    for seq, length in enumerate(LENGTHS):
        k_ref, v_ref = _reference(kv.codec, k_all[seq], v_all[seq], length)
        want = dense_attention_reference(jnp.asarray(q[seq:seq + 1]), k_ref[:length],
                                         v_ref[:length], jnp.asarray([length - 1]))
        np.testing.assert_allclose(np.asarray(got[seq]), np.asarray(want[0]), atol=2e-5,
                                   rtol=2e-5)
    assert kv.codec.num_quantized(max(LENGTHS)) > 0, "the test must read some codes"


@pytest.mark.parametrize("name,options", CODECS + KIVI, ids=IDS + _ids(KIVI))
def test_quantized_pool_is_smaller_and_its_bytes_are_exact(name, options):
    opts = {**options, "page_size": PAGE_SIZE}
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name,
                                     num_seq_slots=NUM_SEQ_SLOTS, **opts)
    per_token = quantized.kv_bytes_per_token(CONFIG, name, **opts)
    meta = 2 if options.get("metadata_dtype") == "float16" else 4
    bits = {"int4": 4, "kivi4": 4, "int2": 2, "kivi2": 2}.get(name)
    if name == "none":
        expected = 2 * L * K * D * 4
    elif bits is None:  # int8 and fp8 (whose dynamic scale is float32 whatever the option)
        expected = 2 * L * K * (D + meta)
    else:
        expected = 2 * L * K * (D * bits / 8 + 2 * meta * D / options["group"])
    assert per_token == expected
    windows = 0
    if name.startswith("kivi"):
        windows = 2 * L * NUM_SEQ_SLOTS * (options.get("residual", 0) + options["group"]) * K * D
        windows *= 4  # float32 K and V of each slot's window
    assert quantized.residual_bytes(CONFIG, NUM_SEQ_SLOTS, name, **opts) == windows
    assert kv.nbytes() == NUM_PAGES * PAGE_SIZE * per_token + windows
    if name != "none":
        assert per_token < CONFIG.kv_bytes_per_token(jnp.float32)


def test_copy_pages_copies_everything_a_page_reads():
    rng, block_tables, free_pages, k_all, v_all = _setup(seed=3)
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, "int4", group=8)
    lengths = (5, 8, 22)
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


def test_kivi_fork_copies_pages_and_window_and_reads_the_same():
    kv, block_tables, free_pages, _, _ = _write_kivi("kivi4", {"group": 4, "residual": 8}, 3)
    src = block_tables[2, :4]
    dst = free_pages[:4]
    forked = jax.jit(lambda kv: kv.copy_pages(jnp.asarray(src), jnp.asarray(dst)).copy_window(
            jnp.int32(SEQ_SLOTS[2]), jnp.int32(1)))(kv)
    k_before, v_before = _read_rows(kv, LAYER, block_tables, LENGTHS)
    tables = block_tables.copy()
    tables[2, :4] = dst
    slots = list(SEQ_SLOTS)
    slots[2] = 1
    loader_tables, load = forked.row_loader(jnp.int32(LAYER), jnp.asarray(tables),
                                            jnp.asarray(LENGTHS, jnp.int32), jnp.asarray(slots))
    k_after, v_after = (np.asarray(x).reshape(k_before.shape)
                        for x in jax.jit(load)(loader_tables))
    n = LENGTHS[2]
    np.testing.assert_array_equal(k_after[2, :n], k_before[2, :n])
    np.testing.assert_array_equal(v_after[2, :n], v_before[2, :n])


@pytest.mark.parametrize("rotated", [False, True], ids=["moved", "rotated"])
@pytest.mark.parametrize("name,options", KIVI, ids=_ids(KIVI))
def test_kivi_compaction_reads_back_the_kept_tokens_laid_out_again(name, options, rotated):
    """Oracle: a KIVI sequence that keeps some of its tokens reads back the round trip of a
    fresh sequence of the values it read before (keys rotated where asked); a page kept in
    place reads bit for bit what it did, and the other sequences do not change."""
    from kvjax.kv import retention
    from kvjax.models.rope import RoPE

    kv, block_tables, free_pages, _, _ = _write_kivi(name, options, seed=7)
    seq, old_len = 2, LENGTHS[2]
    k_before, v_before = _read_rows(kv, LAYER, block_tables, LENGTHS)
    keep = np.concatenate([np.arange(PAGE_SIZE), [9, 11, 12, 15, 20, 22, 23, 24, 25, 26, 27,
                                                  28, 29]])
    old_table = block_tables[seq, :-(-old_len // PAGE_SIZE)].tolist()
    new_table = [old_table[0], int(free_pages[0]), int(free_pages[1])]
    shifts = np.zeros(len(keep), np.int32)
    if rotated:
        shifts[:2] = 5  # as streaming's sinks turn by the tokens dropped
    layout = retention.SeqLayout(old_table, new_table, seq_slot=SEQ_SLOTS[seq])
    src = np.asarray(old_table)[keep // PAGE_SIZE] * PAGE_SIZE + keep % PAGE_SIZE
    dst = np.asarray(new_table)[np.arange(len(keep)) // PAGE_SIZE] * PAGE_SIZE
    dst += np.arange(len(keep)) % PAGE_SIZE
    moved = src != dst
    plan = retention.compaction_of(retention.plan_compaction(
        keep, src[moved], dst[moved], layout, PAGE_SIZE, old_len=old_len, shifts=shifts,
        kept_size=32, moves_size=16, rotations_size=2))
    rope = RoPE(theta=10000.0)
    rotate = rope.rotate if rotated else None
    after = jax.jit(lambda kv, plan: kv.compact(plan, rotate))(kv, plan)

    tables = block_tables.copy()
    tables[seq, :3] = new_table
    lengths = list(LENGTHS)
    lengths[seq] = len(keep)
    k_after, v_after = _read_rows(after, LAYER, tables, lengths)
    x_k, x_v = k_before[seq, keep], v_before[seq, keep]
    if rotated:
        x_k[:2] = np.asarray(rope.rotate(jnp.asarray(x_k[:2]), jnp.asarray(shifts[:2])))
    want_k, want_v = codecs.kivi_roundtrip_reference(jnp.asarray(x_k), jnp.asarray(x_v),
                                                     len(keep), kv.codec)
    # Page 0 keeps its place and, unrotated, its codes: it reads what it did (encoding those
    # values again would round them once more under float16 scales).
    first = PAGE_SIZE if not rotated else 0
    np.testing.assert_array_equal(k_after[seq, :first], k_before[seq, :first])
    # float16 scales: the jitted encode and the eager reference may round a group's scale and
    # zero to neighbouring float16 values (an ulp is 0.004-0.008 here, times up to 3 levels).
    atol = 2e-2 if options.get("metadata_dtype") == "float16" else 1e-4
    np.testing.assert_allclose(k_after[seq, first:len(keep)], np.asarray(want_k)[first:],
                               atol=atol, rtol=0)
    np.testing.assert_allclose(v_after[seq, first:len(keep)], np.asarray(want_v)[first:],
                               atol=atol, rtol=0)
    for other in (0, 1):
        n = LENGTHS[other]
        np.testing.assert_array_equal(k_after[other, :n], k_before[other, :n])
        np.testing.assert_array_equal(v_after[other, :n], v_before[other, :n])
    assert kv.codec.num_quantized(len(keep)) > PAGE_SIZE, "the test must re-encode a group"


def test_calibrated_fp8_reads_back_its_per_layer_static_scales():
    rng, block_tables, _, k_all, v_all = _setup(seed=4)
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, "fp8_e4m3",
                                     scaling="calibrated")
    with pytest.raises(ValueError, match="calibrate_kv"):
        kv.check_ready()
    k_scale = np.abs(rng.standard_normal((L, K))).astype(np.float32) + 0.01
    v_scale = k_scale * 0.5
    kv = quantized.calibrate_fp8(kv, k_scale, v_scale)
    kv.check_ready()
    assert kv.nbytes() == NUM_PAGES * PAGE_SIZE * 2 * L * K * D  # codes only
    slots, k, v = _step_arrays(rng, [(s, 0, n) for s, n in enumerate(LENGTHS)], block_tables,
                               k_all, v_all)
    kv = _write(kv, jnp.int32(LAYER), slots, k, v)
    k_read, v_read = _read(kv, LAYER, block_tables)
    for seq, n in enumerate(LENGTHS):
        for x, read, scale in ((k_all, k_read, k_scale), (v_all, v_read, v_scale)):
            codec = codecs.Fp8Codec("e4m3", "calibrated", tuple(scale[LAYER].tolist()))
            want = codec.decode(codec.encode(jnp.asarray(x[seq, :n])))
            np.testing.assert_allclose(read[seq, :n], np.asarray(want), atol=ATOL, rtol=0)
    assert "k:fp8_e4m3-s" in kv.codec_name and "/v:fp8_e4m3-s" in kv.codec_name


def test_invalid_options_name_the_offending_value():
    with pytest.raises(ValueError, match="shape"):
        quantized.calibrate_fp8(
                quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "fp8_e4m3",
                                            scaling="calibrated"),
                np.ones((L, K + 1)), np.ones((L, K)))
    with pytest.raises(ValueError, match="scaling='calibrated'"):
        quantized.calibrate_fp8(quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "fp8_e4m3"),
                                np.ones((L, K)), np.ones((L, K)))
    with pytest.raises(ValueError, match="page_size=6"):
        quantized.init_quantized_kv(CONFIG, 4, 6, "kivi2", group=4)
    with pytest.raises(ValueError, match="page_size=16"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "kivi2", group=4, page_size=16)
    with pytest.raises(ValueError, match="num_seq_slots"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "kivi2", group=4, num_seq_slots=0)
    with pytest.raises(ValueError, match="use write_rows"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "kivi2", group=4).write(
                jnp.int32(0), jnp.zeros(1, jnp.int32), jnp.zeros((1, K, D)), jnp.zeros((1, K, D)))
    with pytest.raises(ValueError, match="num_pages"):
        quantized.init_quantized_kv(CONFIG, 0, PAGE_SIZE, "int8")
    with pytest.raises(ValueError, match="head_dim=16"):
        quantized.init_quantized_kv(CONFIG, 4, PAGE_SIZE, "int4")  # group 32 > D
    with pytest.raises(ValueError, match="unknown codec"):
        quantized.kv_bytes_per_token(CONFIG, "int3")
