"""KV specs: the bytes a spec states against the buffers each KV state actually allocates.

The oracle is the state itself: the bytes of its page leaves and sequence-slot leaves (every
array of the pytree), counted from the arrays, never from the spec's formula.
"""

import math

import jax
import jax.numpy as jnp
import pytest

import kvjax
from kvjax.config import ModelConfig
from kvjax.engine import pool as kv_pool
from kvjax.kv import arena, quantized, quest
from kvjax.kv import spec as kv_spec
from kvjax.kv.codecs import IdentityCodec
from kvjax.kv.state import exact_cache_spec, init_contiguous_kv, init_paged_kv
from kvjax.memory.block_manager import AllocStatus
from kvjax.memory.groups import GroupedBlockManager

CONFIG = ModelConfig(vocab_size=16, hidden_size=48, intermediate_size=32, num_layers=3,
                     num_heads=6, num_kv_heads=3, head_dim=16, name="spec-test")
PAGE_SIZE, NUM_PAGES, NUM_SEQ_SLOTS = 8, 5, 3

QUANTIZED = [
        ("none", {}),
        ("int8", {}),
        ("int8", {"metadata_dtype": "float16"}),
        ("int8", {"group": 8}),
        ("int4", {"group": 8}),
        ("int2", {"group": 4, "metadata_dtype": "float16"}),
        ("fp8_e4m3", {}),
        ("fp8_e5m2", {}),
        ("fp8_e4m3", {"scaling": "calibrated"}),
        ("kivi4", {"group": 4}),
        ("kivi4", {"group": 4, "residual": 8}),
        ("kivi2", {"group": 8, "residual": 4, "metadata_dtype": "float16"}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in QUANTIZED]


def _page_bytes(kv) -> float:
    """Bytes one page takes in the state's buffers (every page leaf, every layer)."""
    return sum(x.nbytes for x in kv.page_leaves()) / kv.num_pages


def _seq_slot_bytes(kv) -> float:
    leaves = kv.seq_slot_leaves()
    return sum(x.nbytes for x in leaves) / leaves[0].shape[1] if leaves else 0


def _check(spec: kv_spec.KVCacheSpec, kv, num_seq_slots: int = 0, *, unused_bytes: int = 0
           ) -> None:
    """The spec's page, slot and total bytes are the state's; `unused_bytes`: buffer bytes
    that belong to no page and no slot."""
    assert spec.num_layers == CONFIG.num_layers
    assert spec.page_size == kv.page_size
    assert spec.page_bytes == _page_bytes(kv)
    assert spec.seq_slot_bytes == _seq_slot_bytes(kv)
    assert spec.nbytes(kv.num_pages, num_seq_slots) + unused_bytes == sum(
        x.nbytes for x in jax.tree.leaves(kv))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_paged_and_contiguous_specs_match_their_buffers(dtype):
    spec = exact_cache_spec(CONFIG, PAGE_SIZE, dtype)
    _check(spec, init_paged_kv(CONFIG, NUM_PAGES, PAGE_SIZE, dtype))
    _check(spec, init_contiguous_kv(CONFIG, 2, 4 * PAGE_SIZE, PAGE_SIZE, dtype))
    # A token is its K and V in every layer, nothing else.
    assert spec.bytes_per_token * PAGE_SIZE == spec.page_bytes
    assert spec.bytes_per_token == CONFIG.kv_bytes_per_token(dtype)


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_quantized_spec_matches_its_buffers(name, options):
    spec = quantized.cache_spec(CONFIG, PAGE_SIZE, name, **options)
    kv = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name,
                                     num_seq_slots=NUM_SEQ_SLOTS, **options)
    num_seq_slots = NUM_SEQ_SLOTS if kv.seq_slot_leaves() else 0
    _check(spec, kv, num_seq_slots)
    assert spec.codec_name == kv.codec_name
    assert spec.bytes_per_token == quantized.kv_bytes_per_token(CONFIG, name, **options)
    assert spec.seq_slot_bytes * NUM_SEQ_SLOTS == quantized.residual_bytes(
        CONFIG, NUM_SEQ_SLOTS, name, **options)


@pytest.mark.parametrize("name,options", [("none", {}), ("int8", {}), ("kivi4", {"group": 4})],
                         ids=["exact", "int8", "kivi4"])
def test_quest_spec_counts_the_page_summaries(name, options):
    base = quantized.init_quantized_kv(CONFIG, NUM_PAGES, PAGE_SIZE, name,
                                       num_seq_slots=NUM_SEQ_SLOTS, **options)
    spec = quantized.cache_spec(CONFIG, PAGE_SIZE, name, **options)
    kv = quest.init_quest_kv(base)
    wrapped = quest.summarized_spec(spec)
    _check(wrapped, kv, NUM_SEQ_SLOTS if kv.seq_slot_leaves() else 0)
    assert wrapped.bytes_per_token == spec.bytes_per_token  # summaries are per page
    assert wrapped.page_bytes > spec.page_bytes


@pytest.mark.parametrize("name", ["none", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("spare_words", [0, 37])
def test_arena_spec_matches_its_frames(name, spare_words):
    options = {"group": 8} if name == "int4" else {}
    k_codec, v_codec = arena.arena_codecs(CONFIG, jnp.float32, name, **options)
    exact = arena.frame_layout(CONFIG, k_codec, v_codec, 1 << 30)
    frame_words = CONFIG.num_layers * exact.words_per_token * PAGE_SIZE + spare_words
    layout = arena.frame_layout(CONFIG, k_codec, v_codec, frame_words)
    kv = arena.ArenaKV(arena.init_arena(NUM_PAGES, frame_words), layout, k_codec, v_codec)
    spec = arena.arena_cache_spec(CONFIG, layout, k_codec, v_codec)
    assert spec.page_size == PAGE_SIZE
    # A frame's last words past L whole layer blocks belong to no layer and no page.
    _check(spec, kv, unused_bytes=NUM_PAGES * (frame_words % CONFIG.num_layers) * arena.WORD)
    assert spec.bytes_per_token * PAGE_SIZE == (frame_words - spare_words) * arena.WORD
    assert spec.codec_name == kv.codec_name


@pytest.mark.parametrize("config", [
        dict(),
        dict(kv_layout=kvjax.KVLayout.CONTIGUOUS),
        dict(kv_codec="int4", kv_codec_options={"group": 8}),
        dict(kv_codec="kivi2", kv_codec_options={"group": 8, "residual": 8}),
        dict(kv_arena=True, kv_codec="int8"),
], ids=["paged", "contiguous", "int4", "kivi2", "arena-int8"])
def test_pool_is_sized_from_its_spec(config):
    cfg = kvjax.EngineConfig(page_size=PAGE_SIZE, kv_budget_bytes=200_000, max_num_seqs=4,
                             **config)
    pool = kv_pool.build_kv_pool(CONFIG, cfg, max_model_len=64, kv_dtype=jnp.float32)
    kv = pool.kv
    num_seq_slots = kv.num_seq_slots
    assert pool.spec.nbytes(kv.num_pages, num_seq_slots) == sum(
        x.nbytes for x in jax.tree.leaves(kv))
    # Paged pools fill the budget: one more page would not fit.
    if cfg.kv_layout is kvjax.KVLayout.PAGED:
        held = pool.spec.nbytes(kv.num_pages, num_seq_slots)
        assert held <= cfg.kv_budget_bytes < held + pool.spec.page_bytes
    assert pool.kv_bytes_per_token == pool.spec.bytes_per_token


def test_latent_pool_is_sized_from_its_spec():
    """An MLA model's pool: one latent of d_c + d_r per token and layer fills the budget."""
    from kvjax.testing import TINY_MLA

    cfg = kvjax.EngineConfig(page_size=PAGE_SIZE, kv_budget_bytes=200_000, max_num_seqs=4)
    pool = kv_pool.build_kv_pool(TINY_MLA, cfg, max_model_len=64, kv_dtype=jnp.float32)
    (group,) = pool.spec.groups
    assert group.spec.format.store is kv_spec.TokenStore.MLA_LATENT
    m = TINY_MLA.mla
    assert pool.spec.bytes_per_token == TINY_MLA.num_layers * (m.kv_lora_rank
                                                               + m.qk_rope_head_dim) * 4
    assert pool.spec.page_bytes == _page_bytes(pool.kv)
    assert pool.spec.nbytes(pool.kv.num_pages) == sum(x.nbytes for x in jax.tree.leaves(pool.kv))
    held = pool.spec.nbytes(pool.kv.num_pages)
    assert held <= cfg.kv_budget_bytes < held + pool.spec.page_bytes


def test_model_declares_one_global_group_of_every_layer():
    (group,) = CONFIG.kv_layer_groups()
    assert group.layers == tuple(range(CONFIG.num_layers))
    assert group.keep is kv_spec.TokenKeep.ALL
    assert group.format == kv_spec.TokenFormat.kv_heads(CONFIG.num_kv_heads, CONFIG.head_dim)
    assert group.max_tokens_held(10_000) == 10_000


def test_mla_latent_and_sliding_window_bytes():
    """What later groups will declare: an MLA latent stores d_c + d_r values per token, one
    tensor; a window bounds the tokens a layer holds."""
    latent = kv_spec.LayerGroup((0, 1), kv_spec.TokenFormat.mla_latent(512, 64))
    window = kv_spec.LayerGroup((2,), kv_spec.TokenFormat.kv_heads(8, 128),
                                kv_spec.TokenKeep.SLIDING_WINDOW, 512)
    bf16 = IdentityCodec("bfloat16").bytes_per_token
    spec = kv_spec.cache_spec((latent, window), codec_name="none", page_size=16,
                              tensor_bytes=bf16)
    assert [g.bytes_per_token for g in spec.groups] == [2 * 576 * 2, 1 * 2 * 8 * 128 * 2]
    assert spec.bytes_per_token == 2 * 576 * 2 + 2 * 8 * 128 * 2
    assert spec.page_bytes == 16 * spec.bytes_per_token
    assert window.max_tokens_held(4096) == 512
    assert latent.max_tokens_held(4096) == 4096
    with pytest.raises(ValueError, match="one group of global-attention layers"):
        spec.check_single_group()


@pytest.mark.parametrize("groups,match", [
        ([(0, 1), (1, 2)], "exactly once"),
        ([(0,), (2,)], "exactly once"),
        ([], "at least one"),
])
def test_groups_must_cover_every_layer_once(groups, match):
    fmt = kv_spec.TokenFormat.kv_heads(2, 8)
    with pytest.raises(ValueError, match=match):
        kv_spec.cache_spec([kv_spec.LayerGroup(g, fmt) for g in groups], codec_name="none",
                           page_size=8, tensor_bytes=lambda h, w: h * w * 4.0)


@pytest.mark.parametrize("kwargs,match", [
        (dict(keep=kv_spec.TokenKeep.SLIDING_WINDOW), "needs a positive count"),
        (dict(num_keep_tokens=64), "takes none"),
        (dict(keep=kv_spec.TokenKeep.BUDGET, num_keep_tokens=-3), "positive int, got -3"),
])
def test_invalid_keep_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kv_spec.LayerGroup((0,), kv_spec.TokenFormat.kv_heads(2, 8), **kwargs)


def test_budget_with_no_page_is_refused():
    spec = exact_cache_spec(CONFIG, PAGE_SIZE, "float32")
    with pytest.raises(ValueError, match="holds no page"):
        spec.num_pages_for_budget(math.floor(spec.page_bytes) - 1)


@pytest.mark.parametrize("windows,chunk", [((0, 6), 4), ((0, 6, 6, 6), 7), ((13,), 5),
                                           ((3, 0), 1), ((0, 0), 8)])
def test_pages_held_match_the_block_tables_of_a_sequence_written_in_chunks(windows, chunk):
    """A grouped block manager writes a 40-token prompt in chunks, then decodes to 60: at each
    decode step every table together holds `pages_held` pages, and at no point more than
    `max_pages_held`, which is what admission sizes a request by."""
    fmt = kv_spec.TokenFormat.kv_heads(1, 4)
    groups = [kv_spec.LayerGroup((i,), fmt, *((kv_spec.TokenKeep.SLIDING_WINDOW, w) if w
                                              else ())) for i, w in enumerate(windows)]
    spec = kv_spec.cache_spec(groups, codec_name="none", page_size=4,
                              tensor_bytes=lambda h, w: h * w * 4.0)
    alloc = GroupedBlockManager(200, 4, [t.window for t in spec.table_groups()],
                                enable_prefix_cache=False)
    alloc.add_sequence("s", list(range(40)))
    steps = [(s, min(s + chunk, 40)) for s in range(0, 40, chunk)] + [(n, n + 1)
                                                                      for n in range(40, 60)]
    most = 0
    for start, end in steps:
        assert alloc.ensure_writable("s", start, end)[0] is AllocStatus.OK
        most = max(most, alloc.num_held_pages("s"))
        if end - start == 1:
            assert alloc.num_held_pages("s") == spec.pages_held(end)
    assert most <= spec.max_pages_held(60, chunk)
    assert spec.max_pages_held(60, chunk) <= len(spec.table_groups()) * 15
