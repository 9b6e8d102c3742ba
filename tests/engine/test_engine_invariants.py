"""Engine invariants: greedy tokens never depend on memory pressure, caching, batching or order.

The oracle is `greedy_reference`: full recomputation with the cache-free dense forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, KVLayout, PreemptionMode, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.engine.runner import StepObserver
from kvjax.shapes import next_power_of_2
from kvjax.testing import greedy_reference, tiny_model

MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def workload(model):
    rng = np.random.default_rng(0)
    shared = list(rng.integers(0, 120, size=24))
    prompts = []
    for i in range(10):
        own = list(rng.integers(0, 120, size=int(rng.integers(1, 30))))
        prompts.append([int(t) for t in (shared + own if i % 2 else own)])
    refs = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    return prompts, refs


def run(model, prompts, config, **sampling):
    engine = Engine(model, config)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, **sampling))
    return engine, [o.outputs[0].token_ids for o in outs]


BASE = dict(page_size=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=8)


@pytest.mark.parametrize("name,overrides", [
    ("plenty", dict(num_pages=256)),
    ("tiny-recompute", dict(num_pages=22)),
    ("tiny-swap", dict(num_pages=22, preemption_mode=PreemptionMode.SWAP)),
    ("no-prefix-cache", dict(num_pages=256, enable_prefix_cache=False)),
    ("small-chunks", dict(num_pages=256, max_prefill_chunk=3, max_num_batched_tokens=9)),
    ("page-16", dict(num_pages=64, page_size=16)),
    ("contiguous", dict(kv_layout=KVLayout.CONTIGUOUS, max_num_seqs=4)),
    ("scrub", dict(num_pages=22, scrub_freed_pages=True)),
    ("cut-to-buckets", dict(num_pages=256, chunk_bucket_factor=2, min_chunk_bucket=4,
                            prefill_padding_limit=0.125)),
])
def test_greedy_tokens_match_solo_reference(model, workload, name, overrides):
    prompts, refs = workload
    engine, got = run(model, prompts, EngineConfig(**{**BASE, **overrides}))
    assert got == refs
    if name.startswith("tiny"):
        assert engine.stats["preemptions"] > 0, "the budget was meant to force preemption"
    if name == "tiny-swap":
        assert engine.stats["swaps_in"] > 0
    if name == "plenty":
        assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    assert engine.allocator.num_used_pages() == 0  # every page returned


def test_a_prompt_that_needs_the_whole_pool_is_served_alone(model):
    # The watermark keeps 2 of 10 pages free for running sequences; with none running, a
    # prompt whose one chunk needs every page must still be admitted (it used to wait forever).
    engine = Engine(model, EngineConfig(page_size=4, num_pages=10, watermark=0.2,
                                        max_num_batched_tokens=64, max_prefill_chunk=64,
                                        max_num_seqs=2, enable_prefix_cache=False))
    prompt = [int(t) for t in np.random.default_rng(1).integers(
        0, 120, engine.kv_cache.allocator.capacity * 4 - 3)]
    engine.add_request("whole", prompt, SamplingParams(max_new_tokens=3))
    outputs = []
    for _ in range(8):
        outputs += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished():
            break
    assert [o.request_id for o in outputs] == ["whole"]
    assert outputs[0].outputs[0].token_ids == greedy_reference(model, prompt, 3)


def test_random_arrival_order_and_interleaving(model, workload):
    prompts, refs = workload
    rng = np.random.default_rng(1)
    engine = Engine(model, EngineConfig(**BASE, num_pages=40))
    order = rng.permutation(len(prompts))
    results = {}
    for i, idx in enumerate(order):
        engine.add_request(f"r{idx}", prompts[idx], SamplingParams(max_new_tokens=MAX_NEW))
        for _ in range(int(rng.integers(0, 3)) if i < len(order) - 1 else 0):
            for out in engine.step():
                results[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = out.outputs[0].token_ids
    assert [results[f"r{i}"] for i in range(len(prompts))] == refs


def test_parallel_samples_share_prompt_pages(model, workload):
    prompts, refs = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=256))
    (out,) = engine.generate([prompts[1]], SamplingParams(max_new_tokens=MAX_NEW, n=3))
    assert [o.token_ids for o in out.outputs] == [refs[1]] * 3
    (sampled,) = engine.generate([prompts[1]], SamplingParams(
        max_new_tokens=MAX_NEW, n=3, temperature=1.0, seed=5))
    tokens = [o.token_ids for o in sampled.outputs]
    assert len({tuple(t) for t in tokens}) > 1, "samples with different seeds should differ"
    assert engine.allocator.num_used_pages() == 0


def test_seeded_sampling_is_batch_invariant(model, workload):
    prompts, _ = workload
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, top_p=0.9,
                            seed=11)
    engine = Engine(model, EngineConfig(**BASE, num_pages=256))
    (alone,) = engine.generate([prompts[3]], params)
    batch = engine.generate(prompts[:6], params)
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(np.isfinite(batch[3].outputs[0].logprobs))


def test_abort_mid_flight_leaves_others_exact(model, workload):
    prompts, refs = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=64))
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW))
    engine.step()
    engine.step()
    engine.abort("r1")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    aborted = [done.pop("r1", None)]  # The abort is reported by the next step.
    assert done["r0"].outputs[0].token_ids == refs[0]
    assert done["r2"].outputs[0].token_ids == refs[2]
    assert done["r3"].outputs[0].token_ids == refs[3]
    assert any(o is not None and o.outputs[0].finish_reason is FinishReason.ABORT
               for o in aborted)
    assert engine.allocator.num_used_pages() == 0


def test_bad_requests_fail_alone(model, workload):
    prompts, refs = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=64))
    bad = [[], [5, 500], list(range(100)) * 3, prompts[0]]
    bad_params = [SamplingParams(max_new_tokens=MAX_NEW)] * 4
    good = SamplingParams(max_new_tokens=MAX_NEW)
    outs = engine.generate(bad + [prompts[2]], bad_params + [good])
    assert "empty" in outs[0].error
    assert "500" in outs[1].error and "vocabulary" in outs[1].error
    assert "context length" in outs[2].error
    assert outs[3].error is None and outs[3].outputs[0].token_ids == refs[0]
    assert outs[4].outputs[0].token_ids == refs[2]
    engine.add_request("dup", prompts[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("dup", prompts[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.abort("nope")
    with pytest.raises(ValueError, match="pool has"):
        Engine(model, EngineConfig(**BASE, num_pages=4)).add_request(
            "big", prompts[0], SamplingParams(max_new_tokens=200))


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(n=0), "n must"),
    (dict(seed=-1), "seed"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("overrides", [
    dict(num_pages=64),
    # Swap preemption and scrubbing have programs of their own, one per padded page count.
    dict(num_pages=24, preemption_mode="swap", scrub_freed_pages=True),
], ids=["recompute", "swap-scrub"])
def test_compile_count_flat_after_warmup(model, overrides):
    rng = np.random.default_rng(2)
    engine = Engine(model, EngineConfig(**BASE, **overrides))

    def serve(num):
        for i in range(num):
            prompt = [int(t) for t in rng.integers(0, 120, size=int(rng.integers(1, 40)))]
            engine.add_request(f"q{serve.count}-{i}", prompt,
                               SamplingParams(max_new_tokens=int(rng.integers(1, 12))))
            if rng.random() < 0.5:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        serve.count += 1
    serve.count = 0
    # jit caches are keyed by the traced function, so engines of one process share entries:
    # count what this engine's warm-up adds, at most one program per step shape.
    before = engine.num_compiles
    warm = engine.warmup()
    if engine.config.preemption_mode.value == "recompute":
        # One program per step shape, and copy-on-write programs for 1, 2, 4, ... copies up
        # to one per row.
        cfg = engine.config
        num_copy_programs = next_power_of_2(cfg.max_num_seqs + cfg.max_prefill_seqs) \
            .bit_length()
        assert warm - before <= len(engine.step_shapes()) + num_copy_programs
    serve(150)
    serve(150)
    assert engine.num_compiles == warm, f"recompiled after warm-up: {warm} -> {engine.num_compiles}"
    if engine.config.scrub_freed_pages:
        assert engine.stats["swaps_in"] > 0 and engine.stats["scrubbed_pages"] > 0


class _PrefillLayouts(StepObserver):
    """Records (prefill tokens computed, real prefill tokens) of every step with prefill rows."""

    def __init__(self):
        self.steps = []

    def before_step(self, shape, host_input):
        if shape.num_prefill:
            real = int(host_input["q_lens"][shape.num_decode:].sum())
            self.steps.append((shape.num_tokens - shape.num_decode, real))


@pytest.mark.parametrize("rows,limit", [(4, None), (4, 0.125), (1, 0.125)])
def test_prefill_rows_are_packed_and_cut_to_buckets(model, workload, rows, limit):
    """Prefill rows share one padded token range (padding only after the last row); with a
    padding limit and one prefill row, a step's prefill tokens end on a bucket unless padding
    stays under the limit (with more rows, a later row's chunk is cut only where a bucket lies
    inside it)."""
    prompts, refs = workload
    config = EngineConfig(**BASE, num_pages=256, max_prefill_seqs=rows, min_chunk_bucket=4,
                          chunk_bucket_factor=2, prefill_padding_limit=limit)
    engine = Engine(model, config)
    layouts = _PrefillLayouts()
    engine.add_step_observer(layouts)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == refs
    buckets = engine.runner.buckets.prefill_buckets
    if rows > 1:
        assert any(real > 16 for _, real in layouts.steps), "the test wants multi-row prefills"
    for computed, real in layouts.steps:
        assert computed == min(b for b in buckets if b >= real)  # the total pads, not each row
        if limit is not None and rows == 1 and real >= buckets[0]:
            assert computed - real <= limit * computed, (computed, real)
