"""Tests of the joint benchmark driver on a tiny random model with a byte-level tokenizer.

Oracles: the workload's own request list (token counts), the cost model evaluated by hand
on a one-request timeline, the cache-free dense forward pass (teacher-forced scores), and
parameter sizes read from the params pytree (bytes and FLOPs).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from kvjax.bench import runner, trace_report
from kvjax.bench.energy import estimate_energy_j, get_profile
from kvjax.bench.metrics import METRIC_KEYS, quality_stats
from kvjax.bench.workloads import BenchRequest
from kvjax.engine.config import EngineConfig
from kvjax.memory.tiers import TierConfig, TransferLayout
from kvjax.memory.transfer import FaultConfig
from kvjax.models import llama
from kvjax.scheduler.controller import SLO
from kvjax.testing import tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tok_s",
                "goodput_req_s", "duration_s", "kv_utilization_mean", "kv_utilization_peak")


class ByteTokenizer:
    """UTF-8 bytes mapped into the tiny model's vocabulary (ids 3..122), BOS = 1."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([1] if add_bos else []) + [3 + b % 120 for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def tiny_config(**fields) -> ConfigDict:
    """serve_default.py shrunk to the tiny model: 5 step shapes, 128-token contexts."""
    config = runner.load_config(CONFIGS / "serve_default.py")
    config.name = "tiny"
    config.engine.page_size = 8
    config.engine.max_num_seqs = 2
    config.engine.max_num_batched_tokens = 64
    config.engine.max_prefill_chunk = 32
    config.engine.min_chunk_bucket = 32
    config.engine.max_prefill_seqs = 1
    config.engine.max_model_len = 128
    config.workload.num_requests = 6
    config.workload.params = ConfigDict(dict(
        rate=40.0, prompt_dist="uniform", prompt_min=8, prompt_max=40, output_dist="uniform",
        output_min=3, output_max=8))
    config.quality.num_prompts = 2
    config.quality.num_tokens = 6
    return runner.apply_overrides(config, fields | {"name": fields.get("name", "tiny")})


def test_real_clock_run_reports_every_metric_and_counts_a_bad_request(model):
    config = tiny_config()
    requests = runner.build_workload(config, ByteTokenizer())
    too_long = BenchRequest("too-long", 0.01, tuple([5] * 200), 4)  # > max_model_len 128
    result = runner.run_benchmark_detailed(config, model=model, requests=requests + [too_long])
    m = result.metrics

    assert tuple(m) == METRIC_KEYS
    json.dumps(m)
    assert m["clock"] == "real" and m["num_requests"] == 7 and m["failed_requests"] == 1
    assert m["compiles_after_warmup"] == 0
    served = {r.request_id: r for r in result.records if r.error is None}
    assert {r.request_id: r.max_new_tokens for r in requests} == {
        i: r.num_output_tokens for i, r in served.items()}  # EOS is ignored
    total = sum(r.max_new_tokens for r in requests)
    assert m["throughput_tok_s"] == pytest.approx(total / m["duration_s"])
    assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"] <= m["duration_s"]
    assert 0 < m["tpot_p50_s"] <= m["tpot_p99_s"]
    assert 0 < m["kv_utilization_mean"] <= m["kv_utilization_peak"] <= 1
    assert m["bytes_moved"]["device"] > 0 and m["bytes_moved"]["host"] == 0
    assert m["bytes_moved"]["disk"] == 0 and m["energy_j_est"] > 0
    assert m["quality"] is None  # exact KV
    assert m["config"]["engine"]["page_size"] == 8
    assert m["env"]["backend"] == jax.default_backend()
    assert "not fit the context length" in next(r.error for r in result.records if r.error)


def _weight_bytes_per_step(model) -> int:
    """Every parameter but the embedding table (gathered, not read) is read once per step."""
    leaves = jax.tree.leaves(model.params)
    return sum(x.nbytes for x in leaves) - model.params["embed"].nbytes


def test_simulated_clock_follows_the_cost_model(model):
    a, b, c = 0.01, 0.001, 0.0001
    config = tiny_config(**{"clock": "simulated", "sim.step_overhead_s": a,
                            "sim.per_token_s": b, "sim.per_context_token_s": c})
    request = BenchRequest("only", 0.5, tuple(range(3, 23)), 4)  # 20 prompt tokens
    m = runner.run_benchmark(config, model=model, requests=[request])

    prefill = a + b * 32 + c * 20  # the 20-token chunk is padded to the 32 bucket
    decodes = [a + b * 1 + c * kv_len for kv_len in (21, 22, 23)]
    assert m["ttft_p50_s"] == pytest.approx(prefill, rel=1e-12)
    assert m["tpot_p50_s"] == pytest.approx(sum(decodes) / 3, rel=1e-12)
    assert m["duration_s"] == pytest.approx(0.5 + prefill + sum(decodes), rel=1e-12)

    cfg = model.config
    matmul = sum(x.size for x in jax.tree.leaves(model.params["layers"]) if x.ndim == 3)
    pairs = (20 * 20 - 20 * 19 // 2) + 21 + 22 + 23
    flops = (2 * matmul * (32 + 3) + 2 * cfg.hidden_size * cfg.vocab_size * 4
             + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    device = 4 * _weight_bytes_per_step(model) + kv_per_token * ((20 + 3) + (20 + 21 + 22 + 23))
    assert m["bytes_moved"] == {"device": device, "host": 0, "disk": 0}
    assert m["energy_j_est"] == pytest.approx(estimate_energy_j(
        get_profile("cpu"), flops, m["bytes_moved"], m["duration_s"]), rel=1e-12)


@pytest.mark.parametrize("controller", ["fixed", "joint"])
def test_simulated_clock_replays_identically(model, controller):
    """Also under a controller, whose costs use the clock's rates, not measured ones."""
    config = tiny_config(clock="simulated", **{
        "workload.params.rate": 200.0, "engine.controller": controller,
        "engine.num_pages": 12, "slo.kl_budget": 0.5})
    first = runner.run_benchmark(config, model=model, tokenizer=ByteTokenizer())
    second = runner.run_benchmark(config, model=model, tokenizer=ByteTokenizer())
    assert first["ttft_p99_s"] > first["ttft_p50_s"] > 0  # requests queued behind each other
    assert {k: first[k] for k in LATENCY_KEYS} == {k: second[k] for k in LATENCY_KEYS}


def test_samples_of_a_request_each_get_a_record(model):
    config = tiny_config(clock="simulated")
    requests = [BenchRequest("group", 0.0, tuple(range(3, 15)), 5, n=3)]
    result = runner.run_benchmark_detailed(config, model=model, requests=requests)
    assert sorted(r.request_id for r in result.records) == ["group#0", "group#1", "group#2"]
    assert all(r.num_output_tokens == 5 for r in result.records)
    assert result.metrics["throughput_tok_s"] == pytest.approx(15 / result.metrics["duration_s"])


def test_sweep_gives_one_row_per_variant(model, tmp_path):
    config = tiny_config(clock="simulated", **{"workload.tenant_weights": (1, 1)})
    overrides = runner.parse_sweep("engine.scheduler_policy=fcfs,lpm", config)
    results = runner.run_sweep_detailed(config, overrides, model=model,
                                        tokenizer=ByteTokenizer())
    names = ["scheduler_policy=fcfs", "scheduler_policy=lpm"]
    assert [r.metrics["config"]["name"] for r in results] == names
    assert [r.metrics["config"]["engine"]["scheduler_policy"] for r in results] == ["fcfs",
                                                                                  "lpm"]
    paths = runner.write_results(results, tmp_path, command="serve_bench --sweep=...")
    table = [line for line in paths[0].read_text().splitlines() if line.startswith("| ")]
    # The joint table, then the per-tenant TTFT table: one row per variant in each.
    assert [line.split("|")[1].strip() for line in table] == (["run"] + names) * 2
    assert "fairness.per_tenant.tenant-1.ttft_p99_s" in table[3]
    for name in (f"{names[0]}.json", f"{names[1]}.json", "ttft_cdf.png", "kv_memory.png"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / f"{names[1]}.json").read_text())
    assert saved["num_requests"] == results[1].metrics["num_requests"]


def test_sweep_and_overrides_parse_to_typed_values():
    config = tiny_config()
    variants = runner.parse_sweep(
        "engine.scheduler_policy=fcfs,lpm; engine.kv_budget_mb=1.5,2", config)
    assert variants == [
        {"engine.scheduler_policy": "fcfs", "engine.kv_budget_mb": 1.5},
        {"engine.scheduler_policy": "fcfs", "engine.kv_budget_mb": 2.0},
        {"engine.scheduler_policy": "lpm", "engine.kv_budget_mb": 1.5},
        {"engine.scheduler_policy": "lpm", "engine.kv_budget_mb": 2.0},
    ]
    variant = runner.apply_overrides(config, variants[3] | {"workload.params.prompt_min": 9})
    assert variant.name == "scheduler_policy=lpm,kv_budget_mb=2.0,prompt_min=9"
    assert runner.engine_config_from(variant) == EngineConfig(
        page_size=8, kv_budget_bytes=2 * 2**20, max_num_seqs=2, max_num_batched_tokens=64,
        max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1, max_model_len=128,
        scheduler_policy="lpm",  # the run's SLO is every request's unless it names its own
        slo=SLO(config.slo.ttft_s, config.slo.tpot_s, config.slo.kl_budget))
    assert config.engine.scheduler_policy == "fcfs"  # the base config is untouched
    with pytest.raises(ValueError, match="unknown config field 'engine.page_sise'"):
        runner.parse_sweep("engine.page_sise=8", config)
    with pytest.raises(ValueError, match="cannot read 'big' as int"):
        runner.parse_sweep("engine.page_size=big", config)
    with pytest.raises(ValueError, match="engine.page_size=.*cannot be casted"):
        runner.apply_overrides(config, {"engine.page_size": "big"})


def test_retention_and_tier_fields_reach_the_engine_config():
    config = tiny_config(**{
        "kv.retention": "streaming", "kv.budget": 0.25, "kv.retention_options.num_sinks": 2})
    engine_config = runner.engine_config_from(config)
    assert (engine_config.retention, engine_config.retention_budget) == ("streaming", 32)
    assert engine_config.retention_options == {"num_sinks": 2}
    assert not engine_config.tiers.enabled
    assert runner.engine_config_from(tiny_config(**{"kv.retention": "h2o", "kv.budget": 40})
                                     ).retention_budget == 40

    config = tiny_config(**{
        "tiers.host_budget_mb": 2.0, "tiers.disk_budget_mb": 4.0, "tiers.disk_dir": "/tmp/kv",
        "tiers.transfer_layout": "per_page", "tiers.max_chunk_pages": 8,
        "tiers.timeout_polls": 5, "tiers.max_inflight_loads": 2,
        "tiers.fault_injection.transfer_failure_rate": 0.1,
        "tiers.fault_injection.corruption_rate": 0.2, "tiers.fault_injection.delay_rate": 0.3,
        "tiers.fault_injection.delay_polls": 7, "tiers.fault_injection.seed": 9})
    tiers = runner.engine_config_from(config).tiers
    assert TierConfig(
        host_bytes=2 << 20, disk_bytes=4 << 20, disk_dir="/tmp/kv",
        transfer_layout=TransferLayout.PER_PAGE, max_chunk_pages=8, timeout_polls=5,
        max_inflight_loads=2, faults=FaultConfig(fail_fraction=0.1, corrupt_fraction=0.2,
                                                 delay_fraction=0.3, delay_polls=7, seed=9)
    ) == tiers


@pytest.mark.parametrize("fields, match", [
    ({"kv.retention": "h2o", "kv.budget": 1.5}, "whole tokens"),
    ({"kv.retention": "h2o", "kv.budget": -3.0}, "kv.budget must be > 0"),
    ({"kv.retention": "h2o", "kv.budget": 0.5, "engine.max_model_len": None}, "max_model_len"),
    ({"kv.budget": 64.0}, "'none' takes no retention_budget"),
    ({"kv.retention": "streaming", "kv.budget": 64.0, "engine.kv_layout": "contiguous"},
     "retention='streaming' and kv_layout='contiguous' do not compose"),
    ({"tiers.fault_injection.corruption_rate": 0.1}, "need a host tier"),
    ({"tiers.disk_budget_mb": 8.0}, "need a host tier"),
    ({"tiers.host_budget_mb": 1.0, "tiers.transfer_layout": "layer_first"}, "layer_first"),
])
def test_invalid_retention_and_tier_configs_raise_a_clear_error(fields, match):
    config = tiny_config(**fields)
    with pytest.raises(ValueError, match=match):
        runner.run_benchmark(config, requests=[])  # fails before loading any model


def test_a_run_with_retention_keeps_less_kv_and_scores_its_quality(model):
    overrides = {"clock": "simulated", "workload.params.prompt_min": 40,
                 "workload.params.prompt_max": 60, "workload.params.output_min": 8,
                 "quality.num_prompts": 1}
    tokenizer = ByteTokenizer()
    exact = runner.run_benchmark(tiny_config(**overrides), model=model, tokenizer=tokenizer)
    retained = runner.run_benchmark(
        tiny_config(**overrides, **{"kv.retention": "streaming", "kv.budget": 16.0}),
        model=model, tokenizer=tokenizer)
    assert retained["failed_requests"] == 0  # compaction programs compile on first use
    assert retained["throughput_tok_s"] == pytest.approx(
        exact["throughput_tok_s"] * exact["duration_s"] / retained["duration_s"])
    assert retained["kv_reserved_peak_bytes"] < exact["kv_reserved_peak_bytes"]
    assert 0 < retained["kv_utilization_mean"] <= retained["kv_utilization_peak"] <= 1
    assert retained["bytes_moved"]["device"] < exact["bytes_moved"]["device"]
    assert exact["quality"] is None
    q = retained["quality"]
    assert 0 < q["kl_mean"] <= q["kl_max"] and 0 <= q["top1_agreement"] <= 1


def test_retention_quality_of_a_budget_never_reached_is_exact(model):
    config = tiny_config(**{"kv.retention": "streaming", "kv.budget": 120.0})
    prompt = tuple(range(3, 43))
    quality = runner.measure_quality(config, runner.engine_config_from(config), model,
                              [BenchRequest("r", 0.0, prompt, 4)])
    assert quality["kl_max"] == pytest.approx(0.0, abs=1e-6)
    assert quality["top1_agreement"] == 1.0


def test_quality_scores_the_longest_prompts_when_asked(model):
    """A budget only the long prompt exceeds: "first" scores the short one (exact), "longest"
    the long one (retention acts)."""
    requests = [BenchRequest("short", 0.0, tuple(range(3, 23)), 4),
                BenchRequest("long", 0.0, tuple(range(3, 103)), 4)]
    kl = {}
    for which in ("first", "longest"):
        config = tiny_config(**{"kv.retention": "streaming", "kv.budget": 32.0,
                                "quality.num_prompts": 1, "quality.prompts": which})
        kl[which] = runner.measure_quality(config, runner.engine_config_from(config), model,
                                    requests)["kl_max"]
    assert kl["first"] == pytest.approx(0.0, abs=1e-6) and kl["longest"] > 1e-4
    with pytest.raises(ValueError, match="quality.prompts"):
        runner.check_supported(tiny_config(**{"quality.prompts": "random"}))


def test_a_run_with_a_host_tier_counts_the_bytes_it_moves(model):
    config = tiny_config(**{
        "clock": "simulated", "engine.num_pages": 12, "engine.preemption_mode": "swap",
        "tiers.host_budget_mb": 1.0, "workload.name": "multi_turn",
        "workload.num_requests": 6,
        "workload.params": ConfigDict(dict(rate=40.0, num_turns=3, think_time_s=1.0,
                                           user_min=8, user_max=16, answer_len=8))})
    result = runner.run_benchmark_detailed(config, model=model, tokenizer=ByteTokenizer())
    m = result.metrics
    assert m["failed_requests"] == 0 and m["num_requests"] == 6
    assert m["bytes_moved"]["host"] > 0 and m["bytes_moved"]["disk"] == 0
    page_bytes = runner._new_engine(model, runner.engine_config_from(config)).kv_bytes_per_page
    assert m["bytes_moved"]["host"] % page_bytes == 0
    no_tier = runner.run_benchmark(runner.apply_overrides(config, {"tiers.host_budget_mb": None}),
                                   model=model, tokenizer=ByteTokenizer())
    assert no_tier["prefix_hit_rate"] <= m["prefix_hit_rate"]


def test_tenant_weights_split_requests_rates_and_priorities():
    config = tiny_config(**{"workload.num_requests": 9, "workload.tenant_weights": (2, 1),
                            "workload.tenant_priorities": (0, 5)})
    requests = runner.build_workload(config, ByteTokenizer())
    by_tenant = {t: [r for r in requests if r.tenant == t] for t in ("tenant-0", "tenant-1")}
    assert [len(v) for v in by_tenant.values()] == [6, 3]
    assert {r.priority for r in by_tenant["tenant-1"]} == {5}
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    assert len({r.request_id for r in requests}) == 9


@functools.cache
def _dense_fn(config):
    return jax.jit(lambda params, tokens: jax.nn.log_softmax(
        llama.forward_dense(params, config, tokens), axis=-1))  # [T, V]


def _dense_logprobs(model, tokens, padded_len=64) -> np.ndarray:
    """[len(tokens), V] by the cache-free forward pass; the causal mask makes the padding
    after the sequence irrelevant, and one padded length compiles once."""
    padded = np.zeros(padded_len, np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(_dense_fn(model.config)(model.params, padded))[:len(tokens)]


def _dense_greedy(model, prompt, num_tokens) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(np.argmax(_dense_logprobs(model, tokens)[-1])))
    return tokens[len(prompt):]


def test_score_tokens_matches_the_dense_forward_pass(model):
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 120, size=37)]
    scores = runner.score_tokens(EngineConfig(page_size=8), model, tokens)
    assert scores.shape == (36, model.config.vocab_size)
    np.testing.assert_allclose(scores, _dense_logprobs(model, tokens)[:-1], atol=1e-4)


def test_quality_of_bfloat16_kv_against_exact_kv(model):
    config = tiny_config(clock="simulated", **{"engine.kv_dtype": "bfloat16",
                                               "engine.max_num_seqs": 1})
    requests = runner.build_workload(config, ByteTokenizer())
    quality = runner.run_benchmark(config, model=model, requests=requests)["quality"]

    refs, tests = [], []
    for r in requests[:2]:
        prompt = list(r.prompt_ids)
        sequence = prompt + _dense_greedy(model, prompt, 6)
        refs.append(_dense_logprobs(model, sequence)[len(prompt) - 1:-1])
        test = runner.score_tokens(EngineConfig(page_size=8, kv_dtype="bfloat16"), model,
                                   sequence)
        tests.append(test[len(prompt) - 1:])
    expected = quality_stats(np.concatenate(refs), np.concatenate(tests))
    assert 0 < quality["kl_mean"] <= quality["kl_max"]
    for key in ("kl_mean", "kl_p99", "kl_max"):
        assert quality[key] == pytest.approx(expected[key], rel=0.05)
    assert quality["top1_agreement"] == expected["top1_agreement"]
    assert runner.run_benchmark(tiny_config(clock="simulated"), model=model,
                                requests=requests)["quality"] is None


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("serve_*.py")), ids=lambda p: p.name)
def test_shipped_configs_build_engines_and_workloads(path):
    config = runner.load_config(path)
    for overrides in [{}] + list(config.sweep):
        variant = runner.apply_overrides(config, overrides) if overrides else config
        runner.check_supported(variant)
        runner.engine_config_from(variant)
        small = runner.apply_overrides(variant, {"workload.num_requests": 2})
        assert len(runner.build_workload(small, ByteTokenizer())) == 2


def test_step_cost_fit_recovers_the_cost_model_and_never_goes_negative():
    rng = np.random.default_rng(0)
    layouts = [(int(t), int(s)) for t, s in zip(rng.integers(1, 256, 40),
                                                 rng.integers(0, 2000, 40), strict=True)]
    model = runner.StepCostModel(0.02, 0.003, 1e-5, 1e9)
    steps = [runner.StepRecord(0.0, t, t, s, model.step_seconds(t, s, 0)) for t, s in layouts]
    assert runner.fit_step_cost(steps) == pytest.approx(
        dict(step_overhead_s=0.02, per_token_s=0.003, per_context_token_s=1e-5), rel=1e-6)

    # Durations that fall with context: the best non-negative fit drops the context term.
    falling = [runner.StepRecord(0.0, t, t, s, 0.05 + 0.002 * t - 1e-5 * s) for t, s in layouts]
    fit = runner.fit_step_cost(falling)
    assert fit["per_context_token_s"] == 0.0 and min(fit.values()) >= 0
    a = np.array([[1.0, t] for t, _ in layouts])
    b = np.array([r.duration_s for r in falling])
    expected = np.linalg.lstsq(a, b, rcond=None)[0]
    assert [fit["step_overhead_s"], fit["per_token_s"]] == pytest.approx(expected.tolist())


def test_speculative_run_reports_acceptance_and_tokens_per_step(model):
    """spec.* reaches the engine; the run reports spec.acceptance_rate and tokens_per_step
    from the engine's counters, and serves every token asked for (plain runs report None)."""
    motif = tuple(range(10, 18))
    requests = [BenchRequest(f"r{i}", 0.0, motif * 3 + (20 + i,), 8) for i in range(3)]
    config = tiny_config(clock="simulated")
    plain = runner.run_benchmark_detailed(config, model=model, requests=requests)
    spec = runner.run_benchmark_detailed(
        runner.apply_overrides(config, {"spec.method": "ngram", "spec.num_draft_tokens": 3}),
        model=model, requests=requests)
    assert plain.metrics["spec"] is None
    assert runner.engine_config_from(runner.apply_overrides(
        config, {"spec.method": "sparse_self", "spec.options.window": 32})).spec.options == {
            "window": 32}
    m = spec.metrics["spec"]
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert 1.0 <= m["tokens_per_step"] <= 4.0
    assert [r.num_output_tokens for r in spec.records] == [8, 8, 8]
    assert [r.num_output_tokens for r in plain.records] == [8, 8, 8]


def test_trace_config_writes_a_perfetto_trace_and_report(model, tmp_path):
    result = runner.run_benchmark_detailed(tiny_config(clock="simulated", trace=True),
                                           model=model, tokenizer=ByteTokenizer())
    paths = runner.write_results([result], tmp_path, plots=False)
    trace = json.loads((tmp_path / "tiny.trace.json").read_text())
    assert tmp_path / "tiny.trace.json" in paths
    assert trace_report.validate_trace(trace) == []
    report = trace_report.analyse(trace)
    assert report["event_counts"]["finish"] == result.metrics["num_requests"]
    assert report["event_counts"]["step"] == len(result.steps)
    assert trace_report.plot(report, trace, tmp_path)[0].endswith(".png")
