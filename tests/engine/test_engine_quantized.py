"""The engine over a quantized paged KV state (EngineConfig.kv_codec), on a tiny random model.

Oracles: the cache-free dense forward pass (`llama.forward_dense`) for logits, the exact-KV
engine for greedy tokens, the same codec without memory pressure for preemption and swapping,
and byte counts written out by hand from the codec formats.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TINY, tiny_model

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax.bench.metrics import quality_stats
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.engine.step import LogitsMode
from kvjax.models import llama

MAX_NEW = 8
PAGE_SIZE = 8
# Prompts fit one prefill chunk, so KIVI sees the same chunking with and without preemption.
BASE = dict(page_size=PAGE_SIZE, max_num_batched_tokens=64, max_prefill_chunk=64,
            min_chunk_bucket=64, max_num_seqs=2, max_prefill_seqs=1)
SMALL_POOL = 7  # Forces preemption: two running sequences need up to 12 pages.
CODECS = {
        "int8": {},
        "int4": {"group": 8},
        "int2": {"group": 4},
        "fp8_e4m3": {},
        "fp8_e5m2": {},
        "kivi4": {"group": 4, "page_size": PAGE_SIZE},
        "kivi2": {"group": 4, "page_size": PAGE_SIZE},
}
# int8 KV vs exact, teacher-forced over a 48-token prompt: measured max |logit error| 0.053 of
# the largest |logit| and mean KL 1.7e-3 nats; greedy agreement on the workload 48 / 48.
INT8_MAX_LOGIT_ERROR = 0.1  # relative to the largest |logit| of the exact pass
INT8_MAX_MEAN_KL = 5e-3
INT8_MIN_GREEDY_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 120, size=2 * PAGE_SIZE)]
    out = []
    for i in range(6):
        own = [int(t) for t in rng.integers(0, 120, size=int(rng.integers(3, 20)))]
        out.append(shared + own if i % 2 else own)
    return out


def config(codec: str = "none", **overrides) -> EngineConfig:
    return EngineConfig(**{**BASE, **overrides}, kv_codec=codec,
                        kv_codec_options=CODECS.get(codec, {}))


def serve(model, prompts, engine_config):
    engine = Engine(model, engine_config)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for out in outs:
        assert out.error is None and out.finished
        assert out.outputs[0].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.allocator.num_used_pages() == 0
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def int8_served(model, prompts):
    """An int8 engine after the workload with a small pool, swapping and prefix caching."""
    return serve(model, prompts, config("int8", num_pages=SMALL_POOL,
                                        preemption_mode=PreemptionMode.SWAP))


def test_int8_greedy_tokens_track_exact_kv(model, prompts, int8_served):
    engine, tokens = int8_served
    assert engine.stats["preemptions"] > 0 and engine.stats["swaps_in"] > 0
    assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    _, exact = serve(model, prompts, config(num_pages=64))
    agree = [a == b for got, ref in zip(tokens, exact, strict=True)
             for a, b in zip(got, ref, strict=True)]
    assert np.mean(agree) >= INT8_MIN_GREEDY_AGREEMENT


def test_int8_teacher_forced_logits_within_bound_of_dense_forward(model, int8_served):
    engine, _ = int8_served
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 120, size=48)]
    engine.add_request("scored", prompt, SamplingParams(max_new_tokens=1))
    engine.step(logits_mode=LogitsMode.ALL)  # One prefill chunk: row i is token i.
    got = np.asarray(engine.last_logits)[:len(prompt)]  # [T, V]
    exact = np.asarray(llama.forward_dense(model.params, model.config,
                                           np.asarray(prompt, np.int32)))  # [T, V]
    assert np.max(np.abs(got - exact)) <= INT8_MAX_LOGIT_ERROR * np.max(np.abs(exact))
    assert quality_stats(exact, got)["kl_mean"] <= INT8_MAX_MEAN_KL
    while engine.has_unfinished():
        engine.step()


def _hand_bytes_per_token(codec: str) -> float:
    """All layers, K and V: codes plus float32 metadata, from the codec formats."""
    layers, heads, dim = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    if codec in ("int8", "fp8_e4m3", "fp8_e5m2"):
        per_head = dim + 4  # one byte per element, one float32 scale
    else:
        bits, group = int(codec[-1]), CODECS[codec]["group"]
        per_head = dim * bits / 8 + 2 * 4 * dim / group  # packed codes, scale and zero
    per_token = 2 * layers * heads * per_head
    if codec.startswith("kivi"):
        window = 2 * group * heads * dim * 4 + 4  # float32 K and V of one group, a counter
        per_token += layers * window / PAGE_SIZE
    return per_token


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_page_pool_for_a_byte_budget_grows_by_the_compression_ratio(model, codec):
    budget = 1 << 16
    exact = Engine(model, config(kv_budget_bytes=budget))
    quant = Engine(model, config(codec, kv_budget_bytes=budget))
    float32_per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4
    assert exact.num_pages == budget // (PAGE_SIZE * float32_per_token)
    expected = int(budget // (PAGE_SIZE * _hand_bytes_per_token(codec)))
    assert quant.num_pages == expected
    assert quant.kv.nbytes() <= budget
    if not codec.startswith("kivi"):  # KIVI's float32 window outweighs its codes at D = 8.
        assert quant.num_pages > exact.num_pages


def test_provenance_differs_per_codec_so_prefixes_never_cross(model, prompts, int8_served):
    engines = {codec: Engine(model, config(codec, num_pages=16)) for codec in CODECS}
    engines["none"] = Engine(model, config(num_pages=16))
    fingerprints = {codec: e.provenance() for codec, e in engines.items()}
    assert all(isinstance(f, bytes) for f in fingerprints.values())
    assert len(set(fingerprints.values())) == len(fingerprints)
    assert Engine(model, config("int4", num_pages=16)).provenance() == fingerprints["int4"]
    other_group = EngineConfig(**BASE, num_pages=16, kv_codec="int4",
                               kv_codec_options={"group": 4})
    assert Engine(model, other_group).provenance() != fingerprints["int4"]
    # The int8 engine's prefix cache holds the shared prefix under its own fingerprint only.
    served, _ = int8_served
    allocator = served.allocator
    assert allocator.peek_cached_tokens(prompts[1], cache_key=served.provenance()) > 0
    for codec, fingerprint in fingerprints.items():
        if codec != "int8":
            assert allocator.peek_cached_tokens(prompts[1], cache_key=fingerprint) == 0


@pytest.mark.slow
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_codec_serves_with_preemption_and_prefix_cache(model, prompts, codec):
    plenty, reference = serve(model, prompts, config(codec, num_pages=64))
    assert plenty.prefix_cache_stats()["prefix_hit_tokens"] > 0
    swapped, tokens = serve(model, prompts, config(codec, num_pages=SMALL_POOL,
                                                   preemption_mode=PreemptionMode.SWAP))
    assert swapped.stats["preemptions"] > 0 and swapped.stats["swaps_in"] > 0
    assert tokens == reference
    recomputed, tokens = serve(model, prompts, config(codec, num_pages=SMALL_POOL))
    assert recomputed.stats["preemptions"] > 0
    if not codec.startswith("kivi"):  # KIVI reads depend on chunking, which recompute changes.
        assert tokens == reference
