"""A model with sliding-window layers beside global ones: two KV layer groups in one pool.

Oracles: the cache-free dense greedy reference (which masks each layer to its window), the
same engine with async scheduling off or room for every sequence, the `KVCacheSpec`'s
prediction of the bytes a sequence holds, and for quantized pools a dense forward over keys and
values rounded through the same codec. Transformers parity on the same weights is in
tests/models/test_architectures.py (qwen3-sliding, mistral-window).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.config import PreemptionMode
from kvjax.engine.engine import Engine
from kvjax.engine.snapshot import restore_snapshot, save_snapshot
from kvjax.engine.step import AttentionImpl, LogitsMode, attention_name
from kvjax.kv import codecs, native
from kvjax.kv.state import pages_for
from kvjax.memory.block_manager import RELEASED
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.tiers.config import TierConfig
from kvjax.models import llama
from kvjax.testing import TINY, greedy_reference, tiny_model

WINDOW, P = 8, 4
NEW = 24
FLOAT32_REL_TOL = 1e-4  # of the largest |logit|: float32 summation order, nothing else
BASE = dict(page_size=P, max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=4,
            max_model_len=128)


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(TINY, num_layers=4, layer_windows=(WINDOW, 0, WINDOW, 0),
                                 name="tiny-sliding")
    return tiny_model(config, seed=3)


@pytest.fixture(scope="module")
def workload(model):
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, 120, size=16)]
    prompts = [shared + [int(t) for t in rng.integers(0, 120, size=n)] if i % 2 else
               [int(t) for t in rng.integers(0, 120, size=n)] for i, n in enumerate((5, 19, 3, 9))]
    return prompts, [greedy_reference(model, p, NEW) for p in prompts]


def run(model, prompts, **overrides):
    """Two batches (the second's shared prompt then hits the first's pages)."""
    engine = Engine(model, EngineConfig(**{**BASE, **overrides}))
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    half = len(prompts) // 2
    outs = engine.generate(prompts[:half], greedy) + engine.generate(prompts[half:], greedy)
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("overrides", [
    dict(num_pages=64),
    # Too few pages for every sequence at once: preemption (recompute) with windows released.
    dict(num_pages=24, scrub_freed_pages=True),
])
def test_async_and_sync_decode_the_dense_reference(model, workload, overrides):
    prompts, refs = workload
    engine, got_async = run(model, prompts, async_scheduling=True, **overrides)
    _, got_sync = run(model, prompts, async_scheduling=False, **overrides)
    assert got_async == refs and got_sync == refs
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    if overrides["num_pages"] == 24:
        assert engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
        assert engine.stats["scrubbed_pages"] > 0


@pytest.mark.parametrize("overrides", [
    dict(preemption_mode=PreemptionMode.SWAP),
    # The cost model at a link this fast picks swapping for every preemption.
    dict(preemption_mode=PreemptionMode.AUTO, tiers=TierConfig(
        swap_bandwidth_bytes_per_s=1e15, recompute_tokens_per_s=1.0)),
], ids=["swap", "auto"])
def test_preemption_by_swap_decodes_the_dense_reference(model, workload, overrides,
                                                       monkeypatch):
    """Too few pages for every sequence at once: preempted sequences swap every group's held
    pages to host memory and back into fresh pages of each group; greedy tokens equal the
    dense reference's (and so the unpreempted engine's above), and every page comes back.
    AUTO prices each swap at the pages the sequence's tables hold (a window's table only the
    window's)."""
    prompts, refs = workload
    held, swap_out = [], KVCacheManager.swap_out

    def counted(manager, seq_id, num_computed, **kwargs):
        held.append(sum(int(page) != RELEASED for table in
                        manager.allocator.block_tables(seq_id) for page in table))
        return swap_out(manager, seq_id, num_computed, **kwargs)

    monkeypatch.setattr(KVCacheManager, "swap_out", counted)
    engine, got = run(model, prompts, num_pages=24, scrub_freed_pages=True, **overrides)
    assert got == refs
    assert engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert engine.stats["swaps_out"] == engine.stats["swaps_in"] == engine.stats["preemptions"]
    assert engine.allocator.num_free_pages() == 24  # cached or free: nothing leaked
    decisions = engine.stats["preemption_decisions"]
    is_auto = overrides["preemption_mode"] is PreemptionMode.AUTO
    assert len(decisions) == (engine.stats["preemptions"] if is_auto else 0)
    if is_auto:
        assert [d["swap_bytes"] for d in decisions] == [
            pages * engine.kv_spec.page_bytes for pages in held]
    for d in decisions:
        n = d["num_tokens"]
        assert d["swap_cost_s"] == pytest.approx(2 * d["swap_bytes"] / 1e15)
        if n > 3 * WINDOW:
            assert d["swap_bytes"] < n * engine.kv_bytes_per_token


def test_swapping_both_tables_compiles_nothing_after_warmup(model):
    """A swap gathers and a scrub zeroes the pages of both tables at once, more than one
    table's width for a sequence near max_model_len: warm-up compiles their programs for that
    many pages, so swapping such a sequence out and back compiles nothing new."""
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 120, 120)]
    engine = Engine(model, EngineConfig(**BASE, num_pages=64, scrub_freed_pages=True,
                                        preemption_mode=PreemptionMode.SWAP,
                                        enable_prefix_cache=False))
    compiled = engine.warmup()
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    while len(engine.sequence("r#0").output_ids) < 2:
        engine.step()
    engine.pause("r", to_host=True)
    num_pages = engine.stats["swap_bytes"] // engine.kv_spec.page_bytes
    assert num_pages > engine.block_table_width  # both tables: past one table's buckets
    engine.resume("r")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == greedy_reference(model, prompt, 6)
    assert engine.stats["swaps_in"] == 1
    assert engine.num_compiles == compiled


def test_a_swapped_window_moves_only_the_pages_it_holds(model):
    """Paused to host memory while decoding past the window, a sequence moves every page of
    its global table but only its window's pages, and comes back holding just those; its
    tokens equal the dense reference's."""
    prompt = list(range(1, 41))
    engine = Engine(model, EngineConfig(**BASE, num_pages=64, enable_prefix_cache=False))
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    seq = "r#0"
    while len(engine.sequence(seq).output_ids) < 6:
        engine.step()
    engine.drain()
    num_computed = engine.sequence(seq).num_computed
    global_group, window_group = engine.allocator.groups
    held = [pages_for(num_computed, P), sum(
        p >= 0 for p in window_group.block_table(seq)[:pages_for(num_computed, P)])]
    assert global_group.num_held_pages(seq) >= held[0] > pages_for(WINDOW, P) + 1 >= held[1]
    page_bytes = engine.kv_spec.page_bytes
    engine.pause("r", to_host=True)
    assert engine.stats["swap_bytes"] == sum(held) * page_bytes
    assert engine.allocator.num_free_pages() == 64
    engine.resume("r")
    engine.step()
    assert engine.stats["swaps_in"] == 1
    assert engine.stats["swap_bytes"] == 2 * sum(held) * page_bytes
    assert window_group.num_held_pages(seq) <= pages_for(WINDOW, P) + 1
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == greedy_reference(model, prompt, NEW)
    assert engine.allocator.num_free_pages() == 64


@pytest.mark.parametrize("warm_target", [False, True], ids=["cold", "prefix_hit"])
def test_a_windowed_sequence_migrates_through_a_snapshot(model, tmp_path, warm_target):
    """Saved while decoding past the window, a sequence restores into another engine (from the
    snapshot alone, or sharing the prompt pages the target's prefix cache holds) with only
    its window's pages in the sliding group, and continues with the dense reference's
    tokens; every page comes back when it ends."""
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 120, 40)]
    ref = greedy_reference(model, prompt, NEW)
    config = EngineConfig(**BASE, num_pages=64)
    source, target = Engine(model, config), Engine(model, config)
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    if warm_target:
        target.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
    source.add_request("r", prompt, greedy)
    while len(source.sequence("r#0").output_ids) < 6:
        source.step()
    save_snapshot(source, tmp_path / "snap")
    source.abort("r")
    hits = target.prefix_cache_stats()["prefix_hit_tokens"]
    restore_snapshot(target, tmp_path / "snap")
    assert (target.prefix_cache_stats()["prefix_hit_tokens"] > hits) == warm_target
    global_group, window_group = target.allocator.groups
    n = target.sequence("r#0").num_computed
    assert global_group.num_held_pages("r#0") == pages_for(n, P)
    assert window_group.num_held_pages("r#0") <= pages_for(WINDOW, P) + 1
    outputs = []
    while target.has_unfinished():
        outputs += target.step()
    assert outputs[-1].outputs[0].token_ids == ref
    assert target.allocator.num_free_pages() == 64


def test_a_sequence_holds_its_window_and_the_spec_predicts_its_bytes(model):
    """Decoding past the window, the global group holds every page and the sliding group at
    most the pages its window spans; bytes held stay within two pages per group of what the
    spec predicts at token granularity; the pages come back when the request ends."""
    engine = Engine(model, EngineConfig(**BASE, num_pages=64))
    spec = engine.kv_spec
    assert [t.window for t in spec.table_groups()] == [0, WINDOW]
    engine.add_request("r", list(range(1, 61)), SamplingParams(max_new_tokens=30,
                                                               ignore_eos=True))
    decoding = 0
    while engine.has_unfinished():
        engine.step()
        if not engine.allocator.has_sequence(seq := "r#0"):  # the request's one sequence
            continue
        global_group, window_group = engine.allocator.groups
        n = len(global_group.block_table(seq)) * P  # tokens the tables cover
        assert global_group.num_held_pages(seq) == pages_for(n, P)
        if n > 64:  # decoding: one token a step
            decoding += 1
            assert window_group.num_held_pages(seq) <= pages_for(WINDOW, P) + 1
            held = engine.allocator.num_held_pages(seq) * spec.page_bytes
            assert spec.bytes_held(n - P) <= held <= spec.bytes_held(n) + 4 * spec.page_bytes
    assert decoding > 20
    assert engine.allocator.num_free_pages() == 64  # cached or free: nothing leaked


def test_the_same_budget_runs_more_sequences_at_once(model):
    """At a byte budget that holds two whole sequences, the all-global model must preempt;
    with the windows, the same budget runs all four together without preempting."""
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 120, 60)] for i in range(4)]
    global_model = tiny_model(dataclasses.replace(model.config, layer_windows=()), seed=3)
    budget = 2 * (60 + NEW) * global_model.config.kv_bytes_per_token("float32")

    def most_running(m):
        engine = Engine(m, EngineConfig(**{**BASE, "max_num_batched_tokens": 64,
                                           "max_prefill_chunk": 64},
                                        kv_budget_bytes=budget, enable_prefix_cache=False))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        most = 0
        while engine.has_unfinished():
            engine.step()
            most = max(most, len(engine.scheduler.running))
        return most, engine.stats["preemptions"]

    assert most_running(global_model)[1] > 0
    assert most_running(model) == (4, 0)


def codec_dense_reference(model, tokens: list[int], codec_name: str, **options
                          ) -> np.ndarray:
    """[T, V] logits of a cache-free dense forward whose every layer attends over its keys and
    values rounded through the codec (int8: one scale per token and head), each layer masked
    to its window: what a pool of that codec computes, without pages, tables or groups."""
    config, codec = model.config, codecs.get_codec(codec_name, **options)
    t = len(tokens)
    positions = jnp.arange(t, dtype=jnp.int32)
    behind = positions[:, None] - positions[None, :]  # [T, S]
    windows = jnp.asarray([config.layer_window(i) for i in range(config.num_layers)], jnp.int32)

    def attend(layer, q, k, v, cache):
        k, v = (codec.decode(codec.encode(x)).astype(jnp.float32) for x in (k, v))  # [S, K, D]
        visible = (behind >= 0) & ((windows[layer] <= 0) | (behind < windows[layer]))
        qg = q.reshape(t, config.num_kv_heads, config.group_size, config.head_dim)
        scores = jnp.einsum("tkgd,skd->kgts", qg.astype(jnp.float32), k) / np.sqrt(
            config.head_dim)  # [K, G, T, S]
        probs = jax.nn.softmax(jnp.where(visible[None, None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("kgts,skd->tkgd", probs, v)  # [T, K, G, D]
        return out.reshape(t, config.num_heads, config.head_dim).astype(q.dtype), cache

    h, _ = llama.decode_body(model.params, config, jnp.asarray(tokens, jnp.int32), positions,
                             attend, None)
    return np.asarray(llama.lm_head(model.params, config, h))


@pytest.mark.parametrize("codec", [("int8", {}), ("int4", {"group": 8})], ids=lambda c: c[0])
def test_quantized_pools_per_table_group_compute_windowed_attention(model, codec):
    """Codes and scales laid out per table group (pages of one group's two layers): a 48-token
    prompt's teacher-forced logits (windows of 8 binding) equal the dense forward's over keys
    and values rounded through the same codec to float32 rounding, while exact KV's differ
    from it by the codec's error."""
    name, options = codec
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 120, size=48)]
    engine = Engine(model, EngineConfig(**{**BASE, "max_num_batched_tokens": 64,
                                           "max_prefill_chunk": 64},
                                        num_pages=64, kv_codec=name, kv_codec_options=options))
    assert engine.kv.page_leaves()[0].shape[0] == 2  # each page: one group's two layers
    engine.add_request("scored", prompt, SamplingParams(max_new_tokens=1))
    engine.step(logits_mode=LogitsMode.ALL)  # one prefill chunk: row i is token i
    got = np.asarray(engine.last_logits)[:len(prompt)]  # [T, V]
    ref = codec_dense_reference(model, prompt, name, **options)
    exact = np.asarray(llama.forward_dense(model.params, model.config,
                                           np.asarray(prompt, np.int32)))
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(got - ref)) <= FLOAT32_REL_TOL * scale
    assert np.max(np.abs(exact - ref)) > 100 * FLOAT32_REL_TOL * scale  # the rounding shows


def test_int8_windowed_tokens_survive_swap_preemption(model, workload):
    """Swapped int8 pages come back as the same codes and scales: greedy tokens under forced
    swap preemption (and prefix hits) equal the same engine's with room for everyone."""
    prompts, _ = workload
    roomy, expected = run(model, prompts, num_pages=64, kv_codec="int8")
    engine, got = run(model, prompts, num_pages=24, kv_codec="int8",
                      preemption_mode=PreemptionMode.SWAP)
    assert engine.stats["swaps_in"] > 0 and roomy.stats["preemptions"] == 0
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    assert got == expected
    assert engine.allocator.num_free_pages() == 24


def test_windowed_models_refuse_features_that_move_one_table(model):
    for overrides, setting in ((dict(kv_codec="kivi4"), "kv_codec"),
                               (dict(retention="h2o", retention_budget=16), "retention")):
        with pytest.raises(ValueError, match=f"{setting}.*layer_groups"):
            Engine(model, EngineConfig(**BASE, **overrides))
    # Calibrated fp8 scales are per model layer; a grouped page indexes layers within a group.
    with pytest.raises(ValueError, match="calibrated scales does not serve model 'tiny-sliding'"):
        Engine(model, EngineConfig(**BASE, kv_codec="fp8_e4m3",
                                   kv_codec_options=dict(scaling="calibrated")))


@pytest.mark.skipif(native.unavailable_reason() is not None,
                    reason=str(native.unavailable_reason()))
def test_window_layers_run_the_native_kernels_like_the_dense_reference():
    """Head dim 64: windowed and global layers alike prefill (chunks past the window) and
    decode through the native kernels, each layer's window a traced value of one program;
    greedy tokens equal the dense reference's."""
    config = dataclasses.replace(TINY, num_layers=4, head_dim=64, layer_windows=(WINDOW, 0) * 2,
                                 name="tiny-sliding-64")
    model = tiny_model(config, seed=4)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (37, 6)]
    engine = Engine(model, EngineConfig(**BASE, num_pages=64, attention_impl=AttentionImpl.NATIVE))
    assert attention_name(AttentionImpl.NATIVE, engine.kv) == "native"
    assert native.prefill_reason_for(engine.kv) is None
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_reference(model, p, NEW)
                                                      for p in prompts]


def test_admission_counts_every_block_table_and_only_a_windows_pages(model):
    """A request is sized by the pages its two block tables hold at once: the global table every
    page, the window's its 8 tokens plus a 16-token prefill chunk (at most 7 pages of 4). In 20
    pages a 52-token request (13 + 7) is admitted, though its full length on both tables (26
    pages) is not, and runs to the end; a 56-token one (14 + 7) is refused."""
    engine = Engine(model, EngineConfig(**BASE, num_pages=20, enable_prefix_cache=False))
    with pytest.raises(ValueError, match="request 'long' needs 21 KV pages but the pool has 20"):
        engine.add_request("long", list(range(1, 33)), SamplingParams(max_new_tokens=24))
    (out,) = engine.generate([list(range(1, 29))], SamplingParams(max_new_tokens=24,
                                                                  ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 24 and engine.stats["preemptions"] == 0
