"""Non-prefix context reuse: chunks cached once, copied in at any position, corrected by strategy.

Oracles: the cache-free dense forward pass (`greedy_reference`) for the exact cases ('full',
a chunk with no context before it, CacheBlend recomputing every token), and a dense forward
pass with the attention mask that plain concatenation means: each chunk token attends only to
its own chunk, every other token to everything before it (RoPE scores depend on relative
positions only, so a chunk computed at 0 and re-rotated is that chunk encoded in place).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import Engine, EngineConfig, SamplingParams, Segment
from kvjax.memory.ops import KVOpKind
from kvjax.models import llama
from kvjax.models.rope import RoPE, RopeType
from kvjax.scheduler.replay import replay
from kvjax.testing import greedy_reference, tiny_model

P = 4
NUM_NEW = 5
RNG = np.random.default_rng(7)
SYS, DOC_A, DOC_B, QUESTION = (list(map(int, RNG.integers(1, 127, n))) for n in (5, 14, 9, 4))
GREEDY = SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _engine(model, strategy="none", **overrides):
    config = dict(page_size=P, num_pages=96, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=32, max_prefill_chunk=16, min_chunk_bucket=16,
                  context_reuse=strategy)
    config.update(overrides)
    return Engine(model, EngineConfig(**config))


def _rag(*docs):
    return [Segment(SYS), *(Segment(d, reuse=True) for d in docs), Segment(QUESTION)]


def _tokens(engine, prompts, **kw):
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, **kw)]


def _spans(segments):
    out, pos = [], 0
    for seg in segments:
        if seg.reuse:
            out.append((pos, pos + len(seg.ids)))
        pos += len(seg.ids)
    return out


@functools.cache
def _masked_logits(config):
    @jax.jit
    def run(params, tokens, chunk_of, key_scale):
        """Logits [T, V]; chunk_of [T]: each token's chunk id, -1 outside chunks."""
        t = tokens.shape[0]
        causal = jnp.tril(jnp.ones((t, t), bool))
        inside = chunk_of[:, None] >= 0
        mask = causal & (~inside | (chunk_of[:, None] == chunk_of[None, :]))
        scale = jnp.where(~inside & (chunk_of[None, :] >= 0), key_scale, 1.0)  # [T, S]

        def attend(_, q, k, v, cache):
            g = config.group_size
            qg = q.reshape(t, config.num_kv_heads, g, config.head_dim)
            scores = jnp.einsum("tkgd,skd->kgts", qg, k) / np.sqrt(config.head_dim)
            scores = jnp.where(mask[None, None], scores * scale[None, None], -jnp.inf)
            out = jnp.einsum("kgts,skd->tkgd", jax.nn.softmax(scores, -1), v)
            return out.reshape(t, config.num_heads, config.head_dim), cache

        h, _ = llama.decode_body(params, config, tokens, jnp.arange(t), attend, None)
        return llama.lm_head(params, config, h)

    return run


def concat_reference(model, segments, num_new, key_scale=1.0):
    """Greedy tokens of plain concatenation of independently encoded chunks (the mask above)."""
    tokens = [t for s in segments for t in s.ids]
    chunk_of = np.full(64, -1, np.int32)
    for i, (a, b) in enumerate(_spans(segments)):
        chunk_of[a:b] = i
    out = []
    for _ in range(num_new):
        padded = np.zeros(64, np.int32)
        padded[:len(tokens)] = tokens
        logits = _masked_logits(model.config)(model.params, padded, chunk_of,
                                              np.float32(key_scale))
        out.append(int(jnp.argmax(logits[len(tokens) - 1])))
        tokens.append(out[-1])
    return out


def _cached_kv(engine, seq_id, positions):
    """K, V [L, n, K, D] of a live sequence's cache positions."""
    table = np.asarray(engine.kv_cache.block_table(seq_id))
    pos = np.asarray(positions)
    slots = table[pos // P] * P + pos % P
    k, v = (np.asarray(x) for x in engine.kv.page_leaves())
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])[:, slots]  # noqa: E731
    return flat(k), flat(v)


def test_full_recomputes_everything_like_a_plain_prompt(model):
    prompts = [_rag(DOC_A, DOC_B), _rag(DOC_B, DOC_A)]
    engine = _engine(model, "full")
    got = _tokens(engine, prompts)
    assert got == [greedy_reference(model, [t for s in p for t in s.ids], NUM_NEW)
                   for p in prompts]
    assert engine.stats["chunk_lookups"] == 0 and engine.stats["chunk_fill_tokens"] == 0


def test_concatenation_matches_independent_encoding_and_reuses_across_orders(model):
    engine = _engine(model, "none")
    first, second = _rag(DOC_A, DOC_B), _rag(DOC_B, DOC_A)
    assert _tokens(engine, [first]) == [concat_reference(model, first, NUM_NEW)]
    filled = engine.stats["chunk_fill_tokens"]
    assert filled == 16 + 12  # both documents, padded to pages, computed once
    assert _tokens(engine, [second]) == [concat_reference(model, second, NUM_NEW)]
    assert engine.stats["chunk_fill_tokens"] == filled  # the other order reuses both
    assert engine.stats["chunk_reused_tokens"] == 2 * (len(DOC_A) + len(DOC_B))
    assert engine.allocator.num_used_pages() == 0


def test_ape_scales_the_attention_later_tokens_pay_to_chunks(model):
    engine = _engine(model, "ape", context_reuse_options=dict(temperature=0.5,
                                                              shared_prefix=False))
    prompt = _rag(DOC_A, DOC_B)
    assert _tokens(engine, [prompt]) == [concat_reference(model, prompt, NUM_NEW, 2.0)]


def test_ape_encodes_chunks_after_the_shared_prefix(model):
    """Each chunk is computed after the system prompt: the first chunk, which follows it in
    the prompt too, is then exact in every layer; the second misses only the first chunk."""
    kvs = {}
    for strategy, options in (("ape", dict(temperature=1.0)), ("full", {})):
        engine = _engine(model, strategy, context_reuse_options=options,
                         async_scheduling=False)
        engine.add_request("a", _rag(DOC_A, DOC_B),
                           SamplingParams(max_new_tokens=40, ignore_eos=True))
        while engine.stats["decode_tokens"] < 2:
            engine.step()
        kvs[strategy] = _cached_kv(engine, "a#0", range(len(SYS) + len(DOC_A) + len(DOC_B)))
    (k_ape, v_ape), (k_full, v_full) = kvs["ape"], kvs["full"]
    first = slice(0, len(SYS) + len(DOC_A))
    np.testing.assert_allclose(k_ape[:, first], k_full[:, first], atol=1e-5)
    np.testing.assert_allclose(v_ape[:, first], v_full[:, first], atol=1e-5)
    second = slice(first.stop, None)
    np.testing.assert_allclose(k_ape[0, second], k_full[0, second], atol=1e-5)
    assert np.abs(k_ape[1, second] - k_full[1, second]).max() > 1e-2


@pytest.mark.parametrize("strategy", ["none", "epic", "cacheblend"])
def test_a_chunk_with_no_context_before_it_is_exact(model, strategy):
    prompt = [Segment(DOC_A, reuse=True), Segment(QUESTION)]
    got = _tokens(_engine(model, strategy), [prompt])
    assert got == [greedy_reference(model, DOC_A + QUESTION, NUM_NEW)]


# A scaled RoPE whose keys still turn by a shift (YaRN: scaled frequencies, cos/sin times an
# attention factor), from a pre-training length the prompts run past.
YARN = RoPE(RopeType.YARN, factor=4.0, original_max_position_embeddings=16, attention_factor=1.2)


@pytest.mark.parametrize("rope", [None, YARN], ids=["default_rope", "yarn"])
def test_rerotated_chunk_keys_equal_keys_computed_in_place(model, rope):
    """Layer 0's K/V depend on the token and its position only: the copy is exact there; the
    next layer's differ, as the chunk was computed without the context."""
    if rope is not None:
        model = tiny_model(dataclasses.replace(model.config, rope=rope))
    kvs = {}
    for strategy in ("none", "full"):
        engine = _engine(model, strategy, async_scheduling=False)
        engine.add_request("a", _rag(DOC_A), SamplingParams(max_new_tokens=40, ignore_eos=True))
        while engine.stats["decode_tokens"] < 2:
            engine.step()
        kvs[strategy] = _cached_kv(engine, "a#0", range(len(SYS), len(SYS) + len(DOC_A)))
    (k_reused, v_reused), (k_exact, v_exact) = kvs["none"], kvs["full"]
    np.testing.assert_allclose(k_reused[0], k_exact[0], atol=1e-5)
    np.testing.assert_allclose(v_reused[0], v_exact[0], atol=1e-6)
    assert np.abs(k_reused[1] - k_exact[1]).max() > 1e-2


def test_epic_recomputes_the_first_tokens_of_a_chunk_with_the_context(model):
    k = 3
    kvs = {}
    for strategy, options in (("epic", dict(num_tokens=k)), ("full", {})):
        engine = _engine(model, strategy, context_reuse_options=options,
                         async_scheduling=False)
        engine.add_request("a", _rag(DOC_A), SamplingParams(max_new_tokens=40, ignore_eos=True))
        while engine.stats["decode_tokens"] < 2:
            engine.step()
        kvs[strategy] = _cached_kv(engine, "a#0", range(len(SYS), len(SYS) + len(DOC_A)))
    np.testing.assert_allclose(kvs["epic"][0][:, :k], kvs["full"][0][:, :k], atol=1e-5)
    np.testing.assert_allclose(kvs["epic"][1][:, :k], kvs["full"][1][:, :k], atol=1e-5)
    assert np.abs(kvs["epic"][0][1, k:] - kvs["full"][0][1, k:]).max() > 1e-2


def test_cacheblend_recomputing_every_token_is_exact(model):
    engine = _engine(model, "cacheblend", context_reuse_options=dict(ratio=1.0))
    prompts = [_rag(DOC_A, DOC_B), _rag(DOC_B, DOC_A)]
    assert _tokens(engine, prompts) == [
        greedy_reference(model, [t for s in p for t in s.ids], NUM_NEW) for p in prompts]
    assert engine.stats["blend_tokens"] == 2 * (len(DOC_A) + len(DOC_B))


def test_recomputed_tokens_never_write_the_shared_chunk_pages(model):
    engine = _engine(model, "cacheblend", context_reuse_options=dict(ratio=0.5))
    _tokens(engine, [[Segment(DOC_A, reuse=True), Segment(QUESTION)]])  # fills the chunk
    key = engine.scheduler.chunk_cache_key(None, model.weights_version)
    ids = DOC_A + [0] * (-len(DOC_A) % P)
    pages = engine.allocator.prefix_cache.lookup(ids, key)
    assert len(pages) == len(ids) // P
    before = [np.asarray(x)[:, pages] for x in engine.kv.page_leaves()]
    _tokens(engine, [_rag(DOC_A), _rag(DOC_B, DOC_A)])
    assert engine.stats["blend_tokens"] > 0 and engine.stats["chunk_hits"] >= 3
    after = [np.asarray(x)[:, pages] for x in engine.kv.page_leaves()]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(b, a)


def test_tenants_and_weights_versions_never_share_a_chunk(model):
    engine = _engine(model, "none")
    prompt = _rag(DOC_A)
    fills = []
    for tenant in ("alice", "bob", "alice"):
        engine.add_request(f"r{len(fills)}", prompt, GREEDY, tenant=tenant)
        while engine.has_unfinished():
            engine.step()
        fills.append(engine.stats["chunk_fill_tokens"])
    assert fills == [16, 32, 32]  # bob computes his own copy; alice's second request reuses
    engine.update_weights(jax.tree.map(lambda x: x * 1.01, model.params), "v2")
    before = _tokens(engine, [prompt])
    assert engine.stats["chunk_fill_tokens"] == 48  # new weights: the chunk is recomputed
    assert len(before[0]) == NUM_NEW


def test_preemption_and_a_small_pool_change_no_token(model):
    prompts = [_rag(DOC_A, DOC_B), _rag(DOC_B, DOC_A), _rag(DOC_A), _rag(DOC_B)]
    roomy = _tokens(_engine(model, "epic", context_reuse_options=dict(num_tokens=2)), prompts)
    tight = _engine(model, "epic", context_reuse_options=dict(num_tokens=2), num_pages=24)
    assert _tokens(tight, prompts) == roomy
    assert tight.stats["preemptions"] > 0
    assert tight.allocator.num_used_pages() == 0


def test_n_samples_share_the_reused_prompt(model):
    engine = _engine(model, "none")
    prompt = _rag(DOC_A, DOC_B)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True,
                                                   n=2))[0]
    expected = concat_reference(model, prompt, NUM_NEW)
    assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_chunk_loads_travel_as_data_replay_and_compile_nothing_new(model):
    """Each chunk copied into a prompt is a CHUNK_LOAD op in its step's plan, its index arrays
    padded to a power of two; the recorded run replays to the same decisions without a
    device, and no program compiles after warm-up."""
    engine = _engine(model, "cacheblend")
    compiles = engine.warmup()
    recorder = engine.record_decisions()
    short, long_doc = DOC_B[:3], DOC_A + DOC_B
    prompts = [_rag(DOC_A), _rag(short, long_doc), _rag(long_doc)]
    tokens = _tokens(engine, prompts)
    assert engine.num_compiles == compiles
    trace = recorder.stop()
    loads = [op for so in trace.outputs for op in so.kv_plan if op.kind is KVOpKind.CHUNK_LOAD]
    assert len(loads) >= len(prompts)  # every prompt copies at least one chunk in
    for op in loads:
        plan = op.plan
        n = len(plan.dst_slots)
        assert n & (n - 1) == 0 and len(plan.src_pages) == max(n // P, 1) + 1
        written = [s for s in plan.dst_slots if s >= 0]
        assert sorted({s // P for s in written}) == list(op.pages)
        assert 0 <= plan.offset < P
    result = replay(trace)
    assert len(result.outputs) == len(trace.outputs)
    replayed = {o.request_id: o.outputs[0].token_ids for o in result.finished}
    assert [replayed[f"gen-0-{i}"] for i in range(len(prompts))] == tokens


def test_bad_segments_and_strategies_fail_alone(model):
    engine = _engine(model, "none")
    with pytest.raises(ValueError, match="'bad'.*only kvjax.Segment"):
        engine.add_request("bad", [Segment(SYS), 5], GREEDY)
    with pytest.raises(ValueError, match="'odd'.*context_reuse must be one of"):
        engine.add_request("odd", _rag(DOC_A), GREEDY, context_reuse="magic")
    with pytest.raises(ValueError, match="enable_prefix_cache"):
        EngineConfig(context_reuse="epic", enable_prefix_cache=False)
    off = _engine(model, "full", enable_prefix_cache=False)
    with pytest.raises(ValueError, match="'r'.*prefix cache"):
        off.add_request("r", _rag(DOC_A), GREEDY, context_reuse="none")
    assert _tokens(engine, [_rag(DOC_A)]) == [concat_reference(model, _rag(DOC_A), NUM_NEW)]


@pytest.mark.parametrize("policy", ["recompute", "finish_old"])
def test_weight_updates_mid_prefill_read_no_stale_chunk(model, policy):
    import dataclasses

    new_params = jax.tree.map(lambda x: x * 1.02, model.params)
    engine = _engine(model, "none", debug_provenance=True)  # raises on a stale page read
    prompts = [_rag(DOC_A, DOC_B), _rag(DOC_B, DOC_A)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    engine.step()
    engine.update_weights(new_params, "v2", in_flight=policy)
    prompts.append(_rag(DOC_B, DOC_A))  # arrives under the new weights
    engine.add_request("r2", prompts[2], GREEDY)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.outputs[0]) for o in engine.step())
    updated = dataclasses.replace(model, params=new_params)
    versions = []
    for i, prompt in enumerate(prompts):
        out = outs[f"r{i}"]
        (version,) = set(out.weights_versions)  # a request runs under one version only
        versions.append(version)
        served = updated if version == "v2" else model
        assert out.token_ids == concat_reference(served, prompt, NUM_NEW)
    assert versions[2] == "v2"
    assert policy == "finish_old" or set(versions) == {"v2"}
    assert engine.allocator.num_used_pages() == 0


def test_a_registered_strategy_is_chosen_per_request(model):
    import dataclasses

    from kvjax.scheduler.context import STRATEGIES, ChunkPlan, register_strategy

    @dataclasses.dataclass(frozen=True)
    class RecomputeAll:  # reuses the machinery but recomputes every chunk token
        name: str = "recompute_all"
        reuses: bool = True
        fingerprint: str = "recompute_all"

        def plan(self, chunk_len):
            return ChunkPlan(recompute_first=chunk_len)

    register_strategy("recompute_all", RecomputeAll)
    try:
        engine = _engine(model, "none")
        prompt = _rag(DOC_A, DOC_B)
        engine.add_request("own", prompt, GREEDY, context_reuse="recompute_all")
        engine.add_request("default", prompt, GREEDY)
        outs = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
        flat = [t for s in prompt for t in s.ids]
        assert outs["own"] == greedy_reference(model, flat, NUM_NEW)
        assert outs["default"] == concat_reference(model, prompt, NUM_NEW)
        with pytest.raises(ValueError, match="already registered"):
            register_strategy("recompute_all", RecomputeAll)
    finally:
        STRATEGIES.pop("recompute_all")
