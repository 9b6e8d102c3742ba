"""The engine under each retention policy, against a dense masked model of what it should do.

The oracle replays the engine's timeline for one sequence (prefill chunks, then one token per
step) with the cache-free dense forward pass, where query t sees exactly the tokens the policy
kept when t was computed (each at its original position), and decides what to keep with
plain-Python versions of the policies. The engine must produce the same greedy tokens and keep
the same positions after every step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import EngineConfig, KVLayout, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.engine.runner import StepObserver
from kvjax.engine.step import LogitsMode
from kvjax.memory.prefix_cache import hash_page, hash_root
from kvjax.models import llama
from kvjax.models.rope import RoPE, RopeType
from kvjax.testing import greedy_reference, tiny_model

P = 4
CHUNK = 8
BASE = dict(page_size=P, max_num_batched_tokens=CHUNK, max_prefill_chunk=CHUNK,
            min_chunk_bucket=CHUNK, max_num_seqs=4, max_prefill_seqs=1, num_pages=64,
            max_model_len=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 120, size=length)]


# ----------------------------------------------------------------------------- the oracle


@functools.cache
def _masked_forward(config, quest_pages: int, quest_dense_layers: int, num_rotated_sinks: int):
    """Dense forward where visible[t, s] says whether query t sees key s.

    Returns logits [T, V] and the attention probability each key got from each query, summed
    over layers and heads, [T, S]. With quest_pages, queries flagged in `is_decode` see only
    the keys of their quest_pages pages of highest key bound (their own page always), in the
    layers from quest_dense_layers on. With num_rotated_sinks, query t sees the keys of the
    first num_rotated_sinks tokens at sink_shift[t] positions past their own (StreamingLLM's
    in-cache positions: the sinks sit that many tokens closer to the query).
    """
    k_heads, g, d = config.num_kv_heads, config.group_size, config.head_dim

    def run(params, tokens, visible, is_decode, sink_shift):
        t = tokens.shape[0]

        def attend(layer, q, k, v, mass):
            qg = q.reshape(t, k_heads, g, d).astype(jnp.float32)
            kf = k.astype(jnp.float32)
            seen = visible
            if quest_pages:
                pages = kf.reshape(t // P, P, k_heads, d)
                kmin, kmax = pages.min(axis=1), pages.max(axis=1)  # [pages, K, D]
                prod_lo = qg[:, None] * kmin[None, :, :, None, :]  # [T, pages, K, G, D]
                prod_hi = qg[:, None] * kmax[None, :, :, None, :]
                bound = jnp.maximum(prod_lo, prod_hi).sum(-1).max(axis=(2, 3))  # [T, pages]
                own = jnp.arange(t)[:, None] // P
                page = jnp.arange(t // P)[None, :]
                bound = jnp.where(page == own, jnp.inf, jnp.where(page < own, bound, -jnp.inf))
                rank = jnp.argsort(jnp.argsort(-bound, axis=1), axis=1)
                chosen = (rank < quest_pages)[:, jnp.arange(t) // P]  # [T, S]
                is_sparse = is_decode[:, None] & (layer >= quest_dense_layers)
                seen = jnp.where(is_sparse, visible & chosen, visible)
            scores = jnp.einsum("tkgd,skd->kgts", qg, kf) / np.sqrt(d)
            if num_rotated_sinks:
                sinks = jax.vmap(lambda shift: config.rope.rotate(
                    kf[:num_rotated_sinks], jnp.full(num_rotated_sinks, shift)))(
                        sink_shift)  # [T, sinks, K, D]
                sink_scores = jnp.einsum("tkgd,tskd->kgts", qg, sinks) / np.sqrt(d)
                scores = scores.at[..., :num_rotated_sinks].set(sink_scores)
            probs = jax.nn.softmax(jnp.where(seen[None, None], scores, -jnp.inf), axis=-1)
            out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
            return out.reshape(t, -1, d).astype(q.dtype), mass + probs.sum(axis=(0, 1))

        h, mass = llama.decode_body(params, config, tokens, jnp.arange(t), attend,
                                    jnp.zeros((t, t), jnp.float32))
        return llama.lm_head(params, config, h), mass

    return jax.jit(run)


def streaming_keep(budget, sinks):
    def keep(cached, scores, is_done, was_done):
        size = len(cached)
        if size < budget + P:
            return None
        return [i for i in range(size) if i < sinks or size - i <= budget - sinks]
    return keep


def h2o_keep(budget, recent):
    def keep(cached, scores, is_done, was_done):
        size = len(cached)
        if size < budget + P:
            return None
        older = size - recent
        heavy = sorted(range(older), key=lambda i: (-scores[i], i))[:budget - recent]
        return sorted(heavy) + list(range(older, size))
    return keep


def tova_keep(budget):
    def keep(cached, scores, is_done, was_done):
        size = len(cached)
        if size < budget + P:
            return None
        best = sorted(range(size - 1), key=lambda i: (-scores[i], i))[:budget - 1]
        return sorted(best) + [size - 1]
    return keep


def snapkv_keep(budget, window, kernel):
    def keep(cached, scores, is_done, was_done):
        size = len(cached)
        if was_done or not is_done or size <= budget:
            return None
        prefix = size - window
        pooled = [max(scores[j] for j in range(i - kernel // 2, i + kernel // 2 + 1)
                      if 0 <= j < prefix) for i in range(prefix)]
        heavy = sorted(range(prefix), key=lambda i: (-pooled[i], i))[:budget - window]
        return sorted(heavy) + list(range(prefix, size))
    return keep


def oracle(model, prompt, max_new, *, keep=None, weight=None, accumulate=True, quest_pages=0,
           quest_dense_layers=0, rotated_sinks=0):
    """Greedy tokens and the cached positions after every step, replaying the engine's steps.

    weight(query position, length, prefill done before, is the step's last query); accumulate:
    a step's key scores add to the earlier ones, else replace them."""
    total = -(-(len(prompt) + max_new) // P) * P
    tokens = np.zeros(total, np.int32)
    tokens[:len(prompt)] = prompt
    visible = np.eye(total, dtype=bool)  # a row must see something: its own (unused) key
    is_decode = np.arange(total) >= len(prompt)
    forward = _masked_forward(model.config, quest_pages, quest_dense_layers, rotated_sinks)
    sink_shift = np.zeros(total, np.int32)  # tokens evicted when each query was computed
    cached, scores, out, history = [], [], [], []
    length, computed, was_done = len(prompt), 0, False
    while len(out) < max_new:
        queries = list(range(computed, min(computed + CHUNK, length)))
        for i, qpos in enumerate(queries):
            visible[qpos, cached + queries[:i + 1]] = True
        sink_shift[queries] = computed - len(cached)
        logits, mass = forward(model.params, jnp.asarray(tokens), jnp.asarray(visible),
                               jnp.asarray(is_decode), jnp.asarray(sink_shift))
        mass = np.asarray(mass, np.float64)
        weights = [weight(q, length, was_done, q == queries[-1]) if weight else 0.0
                   for q in queries]
        got = sum(w * mass[q] for w, q in zip(weights, queries, strict=True))
        cached = cached + queries
        scores = [s * accumulate + (got[p] if weight else 0.0) for s, p in
                  zip(scores + [0.0] * len(queries), cached, strict=True)]
        computed += len(queries)
        is_done = computed == length
        kept = keep(cached, scores, is_done, was_done) if keep else None
        if kept is not None:
            cached, scores = [cached[i] for i in kept], [scores[i] for i in kept]
        was_done = was_done or is_done
        history.append(list(cached))
        if is_done:
            tokens[length] = int(np.argmax(np.asarray(logits[length - 1])))
            out.append(int(tokens[length]))
            length += 1
    return out, history


class PeakPages(StepObserver):
    """Records the most pages in use at any dispatch.

    A step's pages are allocated before it is dispatched and evicted after it ran.
    """

    def __init__(self, engine):
        self.engine, self.peak = engine, 0
        engine.add_step_observer(self)

    def before_step(self, shape, host_input):
        self.peak = max(self.peak, self.engine.allocator.num_used_pages())


def run_engine(model, prompt, max_new, **config):
    """Greedy tokens, cached positions after every step, and the peak of used pages."""
    engine = Engine(model, EngineConfig(**{**BASE, **config}))
    pages = PeakPages(engine)
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    history, result = [], None
    while engine.has_unfinished():
        for output in engine.step():
            result = output
        history.append(engine.retention.cached_positions("r#0").tolist())
    assert engine.allocator.num_used_pages() == 0
    return result.outputs[0].token_ids, history, pages.peak, engine


CASES = {
    "streaming": (dict(retention="streaming", retention_budget=10,
                       retention_options=dict(num_sinks=2)),
                  dict(keep=streaming_keep(10, 2))),
    "streaming_cache_positions": (dict(retention="streaming", retention_budget=10,
                                       retention_options=dict(num_sinks=2,
                                                              cache_positions=True)),
                                  dict(keep=streaming_keep(10, 2), rotated_sinks=2)),
    "h2o": (dict(retention="h2o", retention_budget=10, retention_options=dict(num_recent=3)),
            dict(keep=h2o_keep(10, 3), weight=lambda q, length, done, last: 1.0)),
    "tova": (dict(retention="tova", retention_budget=10),
             dict(keep=tova_keep(10), weight=lambda q, length, done, last: float(last),
                  accumulate=False)),
    "snapkv": (dict(retention="snapkv", retention_budget=10,
                    retention_options=dict(window=3, kernel=3)),
               dict(keep=snapkv_keep(10, 3, 3),
                    weight=lambda q, length, done, last: float(not done and q >= length - 3))),
    "quest": (dict(retention="quest", retention_budget=2 * P,
                   retention_options=dict(dense_layers=0)), dict(quest_pages=2)),
    "quest_dense": (dict(retention="quest", retention_budget=2 * P,
                         retention_options=dict(dense_layers=1)),
                    dict(quest_pages=2, quest_dense_layers=1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_policy_matches_masked_dense_oracle(model, name):
    config, spec = CASES[name]
    prompt, max_new = prompt_of(22), 12  # chunks of 8, 8, 6: no prompt token decodes alone
    want_tokens, want_history = oracle(model, prompt, max_new, **spec)
    tokens, history, peak, engine = run_engine(model, prompt, max_new, **config)
    assert tokens == want_tokens
    exact = greedy_reference(model, prompt, max_new)
    assert tokens != exact, "the budget was meant to change the output"
    exact_peak = -(-(len(prompt) + max_new - 1) // P)  # the last token is never computed
    if name.startswith("quest"):
        assert engine.retention.stats["evictions"] == 0
        assert peak == exact_peak  # every page stays
        return
    # The finished sequence's record is gone after the last step: compare the others.
    assert history[:-1] == want_history[:-1]
    assert engine.retention.stats["evictions"] > 0
    assert peak < exact_peak
    assert (engine.retention.stats["rotated_slots"] > 0) == ("cache_positions" in name)


def test_rotated_sinks_turn_by_the_models_scaled_rope(model):
    """Under YaRN (scaled frequencies, cos/sin times an attention factor, positions past the
    pre-training length) the sinks' keys turn by the model's own RoPE: the oracle's tokens and
    cached positions."""
    yarn = RoPE(RopeType.YARN, factor=4.0, original_max_position_embeddings=16,
                attention_factor=1.2)
    scaled = tiny_model(dataclasses.replace(model.config, rope=yarn))
    config, spec = CASES["streaming_cache_positions"]
    prompt, max_new = prompt_of(22), 12
    want_tokens, want_history = oracle(scaled, prompt, max_new, **spec)
    tokens, history, _, engine = run_engine(scaled, prompt, max_new, **config)
    assert tokens == want_tokens
    assert history[:-1] == want_history[:-1]
    assert engine.retention.stats["rotated_slots"] > 0


def step_logits(model, prompts, max_new, **config):
    engine = Engine(model, EngineConfig(**{**BASE, "max_num_batched_tokens": 16, **config}))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new))
    logits, outputs = [], {}
    while engine.has_unfinished():
        for output in engine.step(logits_mode=LogitsMode.LAST):
            outputs[output.request_id] = output.outputs[0].token_ids
        logits.append(np.asarray(engine.last_logits))
    return logits, [outputs[f"r{i}"] for i in range(len(prompts))]


def test_budget_never_reached_is_bit_identical_to_exact(model):
    prompts = [prompt_of(n, seed=n) for n in (5, 30)]
    ref_logits, ref_tokens = step_logits(model, prompts, 8)  # retention 'none', the default
    assert ref_tokens == [greedy_reference(model, p, 8) for p in prompts]
    for config in (dict(retention="streaming", retention_budget=60),
                   dict(retention="h2o", retention_budget=60),
                   dict(retention="quest", retention_budget=64)):
        logits, tokens = step_logits(model, prompts, 8, **config)
        assert tokens == ref_tokens, config
        assert len(logits) == len(ref_logits)
        for got, want in zip(logits, ref_logits, strict=True):
            np.testing.assert_array_equal(got, want)


MANY = dict(BASE, max_num_batched_tokens=32, max_prefill_seqs=2, num_pages=128,
            scrub_freed_pages=True)


def serve_many(model, **config):
    """Four 40-token prompts, 16 tokens each: (peak pages used, outputs); checks no leak."""
    engine = Engine(model, EngineConfig(**MANY, **config))
    warm = engine.warmup()
    pages = PeakPages(engine)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_of(40, seed=i),
                           SamplingParams(max_new_tokens=16, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.allocator.num_used_pages() == 0
    assert engine.num_compiles == warm, "compaction or a step compiled after warm-up"
    return pages.peak, outputs


@pytest.fixture(scope="module")
def exact_peak(model):
    return serve_many(model)[0]


@pytest.mark.parametrize("name,budget", [("streaming", 12), ("h2o", 12), ("snapkv", 16),
                                         ("quest", 8)])
def test_many_long_requests_finish_in_fewer_pages_without_leaks(model, exact_peak, name,
                                                                 budget):
    options = {"snapkv": {"window": 4}, "quest": {"dense_layers": 1}}.get(name, {})
    peak, outputs = serve_many(model, retention=name, retention_budget=budget,
                               retention_options=options)
    assert sorted(o.request_id for o in outputs) == [f"r{i}" for i in range(4)]
    assert all(len(o.outputs[0].token_ids) == 16 and
               o.outputs[0].finish_reason is FinishReason.LENGTH for o in outputs)
    if name == "quest":
        assert peak == exact_peak  # Quest saves reads, not memory.
    else:
        assert peak < exact_peak


@pytest.mark.slow
def test_preemption_and_parallel_samples_under_eviction(model):
    prompts = [prompt_of(30, seed=s) for s in range(6)]
    engine = Engine(model, EngineConfig(
        **{**BASE, "max_num_batched_tokens": 32, "max_prefill_seqs": 2, "num_pages": 12},
        retention="h2o", retention_budget=24))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert engine.allocator.num_used_pages() == 0
    engine = Engine(model, EngineConfig(**BASE, retention="h2o", retention_budget=8))
    (group,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=10, n=3,
                                                            ignore_eos=True))
    samples = [o.token_ids for o in group.outputs]
    assert len(samples) == 3 and samples[0] == samples[1] == samples[2]  # greedy, shared KV
    assert engine.retention.stats["evictions"] > 3  # the prompt's, then each sample's own
    assert engine.allocator.num_used_pages() == 0


@pytest.mark.parametrize("options", [dict(num_sinks=4),
                                     dict(num_sinks=2, cache_positions=True)])
def test_prefix_cache_serves_only_pages_computed_before_eviction(model, options):
    """Rotating the sinks (cache_positions) must not touch the indexed first page either."""
    prompt = prompt_of(30, seed=7)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    exact = Engine(model, EngineConfig(**BASE))
    lossy = Engine(model, EngineConfig(**BASE, retention="streaming", retention_budget=8,
                                       retention_options=options))
    for engine in (exact, lossy):
        engine.generate([prompt], params)
    assert lossy.provenance() != exact.provenance()
    assert lossy.retention.stats["evictions"] > 0

    def chain(engine):
        parent = hash_root(engine.provenance())
        hashes = []
        for start in range(0, len(prompt) - P + 1, P):
            parent = hash_page(parent, prompt[start:start + P])
            hashes.append(parent)
        return hashes

    index = lossy.allocator.prefix_cache
    indexed = [index._page_by_hash.get(h) for h in chain(lossy)]
    exact_pages = [exact.allocator.prefix_cache._page_by_hash[h] for h in chain(exact)]
    # Pages written before the first eviction (chunk 1: 8 tokens; chunk 2 reaches 16 >= 8 + P
    # and evicts after it is indexed) stay indexed, with exact content; none after.
    assert [p is not None for p in indexed] == [True] * 4 + [False] * (len(indexed) - 4)
    for page, exact_page in zip(indexed[:4], exact_pages, strict=False):
        np.testing.assert_array_equal(np.asarray(lossy.kv.k_pages[:, page]),
                                      np.asarray(exact.kv.k_pages[:, exact_page]))
        np.testing.assert_array_equal(np.asarray(lossy.kv.v_pages[:, page]),
                                      np.asarray(exact.kv.v_pages[:, exact_page]))
    (again,) = lossy.generate([prompt], params)
    assert again.num_cached_prompt_tokens == 4 * P


def serve_small_pool(model, *, warm: bool, **config):
    """Four 40-token prompts, 16 tokens each, in a 14-page pool: outputs and the engine.

    Without eviction each sequence would hold 14 pages; the pool is a quarter of that.
    warm: warm the engine up first and check that serving compiles nothing more.
    """
    engine = Engine(model, EngineConfig(**{**MANY, "num_pages": 14, **config}))
    num_compiles = engine.warmup() if warm else None
    for i in range(4):
        engine.add_request(f"r{i}", prompt_of(40, seed=i),
                           SamplingParams(max_new_tokens=16, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    assert engine.allocator.num_used_pages() == 0, "pages leaked"
    if warm:
        assert engine.num_compiles == num_compiles, "compaction or a step compiled after warm-up"
    return [outputs[f"r{i}"] for i in range(4)], engine


@pytest.mark.slow
def test_int8_streaming_in_a_small_pool_agrees_with_exact_streaming(model):
    """int8 pages under streaming eviction: every request gets its 16 tokens, no page leaks,
    compaction of the codes compiles nothing after warm-up, and >= 90% of the greedy tokens
    (position by position) equal the exact-KV streaming engine's.
    """
    policy = dict(retention="streaming", retention_budget=12,
                  retention_options=dict(num_sinks=2))
    want, _ = serve_small_pool(model, warm=False, **policy)
    got, engine = serve_small_pool(model, warm=True, kv_codec="int8", **policy)
    assert [len(t) for t in got] == [16] * 4
    assert engine.retention.stats["evictions"] > 0 and engine.retention.stats["moved_slots"] > 0
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.9 * 4 * 16, f"{same} of {4 * 16} tokens agree"


@pytest.mark.parametrize("policy", [
    dict(retention="streaming", retention_budget=12,
         retention_options=dict(num_sinks=2, cache_positions=True)),
    dict(retention="h2o", retention_budget=12, retention_options=dict(num_recent=4)),
    dict(retention="snapkv", retention_budget=32, retention_options=dict(window=8)),
], ids=["streaming_rotated", "h2o", "snapkv"])
def test_kivi_windows_compact_like_exact_pages(model, policy):
    """Oracle: a KIVI window longer than any sequence keeps every token exact, so under
    eviction (the window laid out again, sinks rotated in it, keys scored through it) the
    greedy tokens equal the exact-KV engine's under the same policy; nothing compiles after
    warm-up and no page leaks. (Re-encoded key groups: tests/kv/test_quantized_state.py.)
    No prefix cache: such a KIVI engine publishes no page (none is ever fully quantized), so
    its compactions would find other pages free than the exact engine's."""
    policy = dict(policy, enable_prefix_cache=False)
    want, _ = serve_small_pool(model, warm=False, **policy)
    got, engine = serve_small_pool(model, warm=True, kv_codec="kivi4",
                                   kv_codec_options=dict(group=4, residual=60), **policy)
    assert engine.retention.stats["evictions"] > 0
    assert got == want


@pytest.mark.parametrize("overrides,match", [
    (dict(retention="streaming", retention_budget=8,
          retention_options=dict(num_sinks=P, cache_positions=True)), "num_sinks < page_size"),
    (dict(retention="quest", retention_budget=8, kv_layout=KVLayout.CONTIGUOUS), "paged"),
    (dict(retention="streaming", retention_budget=None), "retention_budget"),
    (dict(retention="sliding"), "'sliding'"),
])
def test_invalid_retention_configs_fail_at_the_boundary(overrides, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{**BASE, **overrides})


@pytest.mark.slow
def test_quest_runs_over_a_quantized_pool(model):
    prompt = prompt_of(30, seed=3)
    config = EngineConfig(**BASE, kv_codec="int8", retention="quest", retention_budget=64)
    plain = dataclasses.replace(config, retention="none", retention_budget=None)
    want = Engine(model, plain).generate([prompt], SamplingParams(max_new_tokens=8))
    got = Engine(model, config).generate([prompt], SamplingParams(max_new_tokens=8))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_quest_over_kivi_reads_its_selected_pages_of_codes_and_window(model):
    """Quest over KIVI: a decode row's narrowed read is its full read (codes for aged tokens,
    the sequence's exact window for the newest) restricted to the pages Quest selected.

    Oracle: attention in numpy over every page the row's loader decodes, masked to the
    selected pages' tokens; the engine's path reads only those pages, through logical tables
    that keep each page's position (so the window rows are the right tokens).
    """
    from kvjax.kv import attention as attention_ref
    from kvjax.kv import quest

    engine = Engine(model, EngineConfig(**{**BASE, **dict(
        kv_codec="kivi4", kv_codec_options=dict(group=4, residual=4), retention="quest",
        retention_budget=2 * P, retention_options=dict(dense_layers=0),
        enable_prefix_cache=False, async_scheduling=False)}))
    # Another sequence takes pages first, so a page's pool index is not its position.
    engine.add_request("x", prompt_of(9, seed=1), SamplingParams(max_new_tokens=12,
                                                                 ignore_eos=True))
    engine.add_request("r", prompt_of(22), SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(7):
        engine.step()
    kv, seq = engine.kv, "r#0"
    kv_len = len(engine.retention.cached_positions(seq))
    table = engine.kv_cache.block_table(seq)
    assert kv_len > 22 and table != list(range(len(table)))
    width = 8
    bt = jnp.asarray([table + [0] * (width - len(table))], jnp.int32)  # [1, W]
    lens, slots = jnp.asarray([kv_len], jnp.int32), jnp.asarray([engine.kv_cache.seq_slot(seq)])
    cfg = model.config
    q = jax.random.normal(jax.random.PRNGKey(3), (1, cfg.num_heads, cfg.head_dim), jnp.float32)
    for layer in map(jnp.int32, range(cfg.num_layers)):
        index, sel_lens = quest.select_decode_pages(kv, layer, q, bt, lens, 2)
        tables, load = kv.row_loader(layer, bt, lens, slots)
        got = attention_ref.paged_attention_blockwise(
            q[:, None], load, jnp.take_along_axis(tables, index, axis=1), sel_lens,
            jnp.ones(1, jnp.int32), pages_per_block=2)[0, 0]  # [N, D]
        chosen = np.asarray(index)[0, :2]
        assert len(set(chosen.tolist())) == 2 and chosen[-1] == (kv_len - 1) // P
        k, v = (np.asarray(x)[0].reshape(width * P, cfg.num_kv_heads, cfg.head_dim)
                for x in load(tables))  # every page, [W * P, K, D]
        positions = np.arange(width * P)
        seen = np.isin(positions // P, chosen) & (positions < kv_len)
        g = cfg.num_heads // cfg.num_kv_heads
        logits = np.einsum("kgd,skd->kgs", np.asarray(q[0]).reshape(-1, g, cfg.head_dim),
                           k) / np.sqrt(cfg.head_dim)
        probs = np.exp(np.where(seen, logits, -np.inf) - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = np.einsum("kgs,skd->kgd", probs, v).reshape(cfg.num_heads, cfg.head_dim)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # The window is read for the newest tokens: they differ from their codes' decoding.
    codes_k, _ = kv.load_pages(jnp.int32(0), bt)
    window_k, _ = load(tables)
    newest = (kv_len - 1) // P, (kv_len - 1) % P
    assert not np.allclose(np.asarray(codes_k)[0][newest], np.asarray(window_k)[0][newest])
