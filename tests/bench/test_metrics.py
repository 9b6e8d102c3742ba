"""Tests of the benchmark metrics and the energy estimate, against hand-computed answers."""

import json
import math

import numpy as np
import pytest

from kvjax.bench import energy, metrics
from kvjax.bench.metrics import RequestRecord, compute_metrics, jain_index, quality_stats

EXPECTED_KEYS = (
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tok_s",
    "goodput_req_s", "kv_utilization_mean", "kv_utilization_peak", "kv_reserved_mean_bytes",
    "kv_reserved_peak_bytes", "prefix_hit_rate", "preemptions", "bytes_moved", "energy_j_est",
    "quality", "kl_spent", "retrieval_accuracy", "fairness",
    "compiles_after_warmup", "padded_token_fraction", "spec", "context_reuse",
    "failed_requests", "num_requests", "duration_s", "clock", "config", "env",
)


def record(request_id, arrival, token_times, *, tenant=None, error=None, num_out=None,
           finish=None, num_prompt=10):
    """A record whose first token is the first of `token_times`."""
    return RequestRecord(
        request_id=request_id, tenant=tenant, arrival_time=arrival,
        first_token_time=token_times[0] if token_times else None,
        token_times=list(token_times),
        finish_time=finish if finish is not None else (token_times[-1] if token_times
                                                       else arrival),
        num_prompt_tokens=num_prompt,
        num_output_tokens=len(token_times) if num_out is None else num_out, error=error)


def timeline():
    """Four served requests and one failed one.

    request  TTFT  TPOT
    a        0.5   (0.8 - 0.5) / 3 = 0.1
    b        0.2   (1.8 - 1.2) / 2 = 0.3
    c        1.0   - (one token)
    d        0.1   (1.1 - 0.1) / 5 = 0.2 (no token_times: finish_time stands for the last)
    e        failed after producing two tokens
    """
    d = RequestRecord("d", None, 0.0, 0.1, [], 1.1, 10, 6, None)
    return [
        record("a", 0.0, [0.5, 0.6, 0.7, 0.8]),
        record("b", 1.0, [1.2, 1.5, 1.8]),
        record("c", 2.0, [3.0]),
        d,
        record("e", 2.5, [2.7, 2.9], error="out of KV memory"),
    ]


def test_schema_is_pinned():
    assert metrics.METRIC_KEYS == EXPECTED_KEYS
    result = compute_metrics([], slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=1.0)
    assert tuple(result) == EXPECTED_KEYS


def test_nothing_measured_gives_none_not_missing():
    result = compute_metrics([], slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=2.0)
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "kv_utilization_mean",
                "kv_utilization_peak", "prefix_hit_rate", "preemptions", "bytes_moved",
                "energy_j_est", "quality", "fairness", "compiles_after_warmup",
                "padded_token_fraction", "config", "env"):
        assert result[key] is None, key
    assert result["throughput_tok_s"] == 0.0 and result["goodput_req_s"] == 0.0
    assert result["num_requests"] == 0 and result["clock"] == "real"


def test_requests_own_slos_judge_goodput_and_kl_spent_aggregates():
    """A record with its own SLO is judged by it (else by the run's); kl_spent is the mean,
    worst and count of degraded requests."""
    import dataclasses

    a, b, c, d, e = timeline()  # TTFT a 0.5, b 0.2, c 1.0, d 0.1
    records = [dataclasses.replace(a, slo_ttft_s=0.4, kl_spent=0.2),  # misses its own TTFT
               dataclasses.replace(b, slo_ttft_s=0.3, slo_tpot_s=0.5),  # meets its own
               dataclasses.replace(c, kl_spent=0.1), d, e]
    result = compute_metrics(records, slo_ttft_s=1.0, slo_tpot_s=0.25, duration_s=1.0)
    # a: own TTFT 0.4 < 0.5 (miss); b: TPOT 0.3 <= own 0.5 (meets); c: TTFT 1.0 (meets, one
    # token); d: TPOT 0.2 <= 0.25 (meets); e failed.
    assert result["goodput_req_s"] == 3.0
    assert result["kl_spent"] == {"mean": pytest.approx(0.075), "max": 0.2,
                                  "degraded_requests": 2}


def test_latency_percentiles_by_hand():
    result = compute_metrics(timeline(), slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=10.0)
    # TTFT sorted [0.1, 0.2, 0.5, 1.0]: p50 halfway between 0.2 and 0.5; p99 at rank
    # 0.99 * 3 = 2.97, i.e. 0.5 + 0.97 * (1.0 - 0.5).
    assert result["ttft_p50_s"] == pytest.approx(0.35)
    assert result["ttft_p99_s"] == pytest.approx(0.985)
    # TPOT sorted [0.1, 0.2, 0.3]: p50 0.2; p99 at rank 1.98: 0.2 + 0.98 * 0.1.
    assert result["tpot_p50_s"] == pytest.approx(0.2)
    assert result["tpot_p99_s"] == pytest.approx(0.298)


def test_throughput_counts_served_tokens_and_failures_separately():
    result = compute_metrics(timeline(), slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=10.0)
    assert result["throughput_tok_s"] == pytest.approx((4 + 3 + 1 + 6) / 10.0)
    assert result["failed_requests"] == 1 and result["num_requests"] == 5


def test_goodput_with_slo_edges():
    # SLO TTFT 0.5, TPOT 0.2: a meets both exactly at the TTFT edge; b misses TPOT (0.3);
    # c misses TTFT (1.0); d meets TTFT and sits exactly on the TPOT edge; e failed.
    result = compute_metrics(timeline(), slo_ttft_s=0.5, slo_tpot_s=0.2, duration_s=10.0)
    assert result["goodput_req_s"] == pytest.approx(2 / 10.0)
    # Just below the edges, a and d drop out.
    result = compute_metrics(timeline(), slo_ttft_s=0.4999, slo_tpot_s=0.1999, duration_s=10.0)
    assert result["goodput_req_s"] == 0.0
    # With no TPOT bound, c still misses TTFT; a single-token request is judged on TTFT alone.
    result = compute_metrics(timeline(), slo_ttft_s=1.0, slo_tpot_s=math.inf, duration_s=4.0)
    assert result["goodput_req_s"] == pytest.approx(4 / 4.0)
    # 0.8 - 0.6 is 0.20000000000000007 in floating point: on the edge all the same.
    rounded = [record("r", 0.6, [0.8, 1.0])]
    result = compute_metrics(rounded, slo_ttft_s=0.2, slo_tpot_s=0.2, duration_s=1.0)
    assert result["goodput_req_s"] == 1.0
    # A fast request that failed never counts.
    failed = [record("x", 0.0, [0.01, 0.02], error="checksum mismatch")]
    result = compute_metrics(failed, slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=1.0)
    assert result["goodput_req_s"] == 0.0 and result["failed_requests"] == 1


def test_request_without_output_has_no_ttft_and_no_goodput():
    empty = [record("z", 0.0, [], num_out=0)]
    result = compute_metrics(empty, slo_ttft_s=1.0, slo_tpot_s=1.0, duration_s=1.0)
    assert result["ttft_p50_s"] is None and result["goodput_req_s"] == 0.0


def test_kv_utilization_is_time_weighted_by_hand():
    # Utilization 0.5 on [0, 1), 1.0 on [1, 3), nothing allocated on [3, 4), 0.25 at t=4
    # (the last sample holds for no time, so it counts for the peak only). Unsorted input.
    samples = [(4.0, 30, 120), (1.0, 100, 100), (0.0, 50, 100), (3.0, 0, 0)]
    result = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=5, kv_samples=samples)
    assert result["kv_utilization_mean"] == pytest.approx((0.5 * 1 + 1.0 * 2) / 3)
    assert result["kv_utilization_peak"] == 1.0
    # Reserved bytes: 100 on [0, 3), 0 on [3, 4); the last sample counts for the peak only.
    assert result["kv_reserved_mean_bytes"] == pytest.approx(100 * 3 / 4)
    assert result["kv_reserved_peak_bytes"] == 120


def test_retrieval_accuracy_counts_probes_of_served_requests_only():
    records = [record("a", 0.0, [0.1]), record("b", 0.0, [0.1]), record("c", 0.0, [0.1]),
               record("d", 0.0, [], error="rejected", num_out=0)]
    records[0].is_correct, records[1].is_correct, records[3].is_correct = True, False, False
    result = compute_metrics(records, slo_ttft_s=1, slo_tpot_s=1, duration_s=1)
    assert result["retrieval_accuracy"] == 0.5
    assert compute_metrics(records[2:3], slo_ttft_s=1, slo_tpot_s=1,
                           duration_s=1)["retrieval_accuracy"] is None


def test_kv_utilization_rejects_live_above_allocated():
    with pytest.raises(ValueError, match="live_token_bytes"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1,
                        kv_samples=[(0.0, 11, 10)])


def test_counters_prefix_hits_preemptions_and_bytes():
    counters = {"prefix_hit_tokens": 30, "prefix_query_tokens": 120, "preemptions": np.int64(3),
                "bytes_moved_host": 4096, "compiles_after_warmup": 0}
    result = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, counters=counters)
    assert result["prefix_hit_rate"] == 0.25
    assert result["preemptions"] == 3 and type(result["preemptions"]) is int
    assert result["bytes_moved"] == {"device": 0, "host": 4096, "disk": 0}
    assert result["compiles_after_warmup"] == 0
    json.dumps(result)
    no_queries = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1,
                                 counters={"prefix_query_tokens": 0})
    assert no_queries["prefix_hit_rate"] is None


def test_unknown_counter_is_rejected():
    with pytest.raises(ValueError, match="prefix_hits"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1,
                        counters={"prefix_hits": 3})


def test_record_validation():
    bad = record("bad", 0.0, [0.1, 0.2], num_out=5)
    with pytest.raises(ValueError, match="'bad'.*token_times"):
        compute_metrics([bad], slo_ttft_s=1, slo_tpot_s=1, duration_s=1)
    early = RequestRecord("early", None, 2.0, 1.0, [1.0], 1.0, 3, 1, None)
    with pytest.raises(ValueError, match="precedes"):
        compute_metrics([early], slo_ttft_s=1, slo_tpot_s=1, duration_s=1)
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=0.0)


def test_jain_index_known_values():
    assert jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)  # one of n served: 1/n
    assert jain_index([1, 2, 3]) == pytest.approx(36 / (3 * 14))
    assert jain_index([0, 0]) == 1.0
    with pytest.raises(ValueError):
        jain_index([])
    with pytest.raises(ValueError):
        jain_index([1, -1])


def test_fairness_per_tenant_service_and_jain():
    records = [
        record("a1", 0.0, [0.1] * 10, tenant="alice", num_prompt=100),
        record("b1", 0.0, [0.2] * 20, tenant="bob", num_prompt=50),
        record("b2", 0.0, [0.4] * 10, tenant="bob", num_prompt=50),
        record("b3", 0.0, [0.3] * 7, tenant="bob", error="preempted", num_prompt=50),
    ]
    result = compute_metrics(records, slo_ttft_s=1, slo_tpot_s=1, duration_s=1)
    fairness = result["fairness"]
    assert fairness["per_tenant"]["alice"]["output_tokens"] == 10
    assert fairness["per_tenant"]["bob"]["output_tokens"] == 30  # the failed one is not served
    assert fairness["per_tenant"]["bob"]["prompt_tokens"] == 100
    assert fairness["per_tenant"]["bob"]["failed_requests"] == 1
    assert fairness["jain_output_tokens"] == pytest.approx(40**2 / (2 * (10**2 + 30**2)))
    assert fairness["jain_prompt_tokens"] == pytest.approx(1.0)
    # bob's TTFTs are 0.2 and 0.4: p99 = 0.2 + 0.99 * 0.2.
    assert fairness["per_tenant"]["bob"]["ttft_p99_s"] == pytest.approx(0.398)
    single = compute_metrics(records[:1], slo_ttft_s=1, slo_tpot_s=1, duration_s=1)
    assert single["fairness"] is None


def reference_kl(logits_ref, logits_test):
    """KL(p || q) written out directly: sum_v p_v * log(p_v / q_v), one row at a time."""
    out = []
    for row_ref, row_test in zip(logits_ref, logits_test, strict=True):
        p = np.exp(row_ref) / np.exp(row_ref).sum()
        q = np.exp(row_test) / np.exp(row_test).sum()
        out.append(sum(pv * math.log(pv / qv) for pv, qv in zip(p, q, strict=True)))
    return np.array(out)


def test_quality_stats_matches_a_direct_formula():
    rng = np.random.default_rng(0)
    logits_ref = rng.normal(size=(50, 40))
    logits_test = logits_ref + rng.normal(scale=0.3, size=(50, 40))
    kl = reference_kl(logits_ref, logits_test)
    # Log-probabilities and raw logits give the same answer.
    log_probs = logits_ref - np.log(np.exp(logits_ref).sum(-1, keepdims=True))
    for ref in (logits_ref, log_probs):
        stats = quality_stats(ref, logits_test)
        assert stats["kl_mean"] == pytest.approx(kl.mean(), rel=1e-9)
        assert stats["kl_max"] == pytest.approx(kl.max(), rel=1e-9)
        assert stats["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    agree = np.mean(logits_ref.argmax(-1) == logits_test.argmax(-1))
    assert stats["top1_agreement"] == pytest.approx(agree)
    assert 0 < agree < 1


def test_quality_stats_identical_inputs():
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(16), size=8))
    stats = quality_stats(logp, logp.copy())
    assert stats == {"kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0, "top1_agreement": 1.0}


def test_quality_stats_top1_and_zero_mass_by_hand():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.5, 1.0, 0.5 - 1e-9],
                           [0.2, 0.3, 0.5]]))
    ref[2, 1] = -np.inf  # the reference gives this token no mass
    test = np.log(np.array([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1],
                            [0.5, 0.3, 0.2]]))
    stats = quality_stats(ref, test)
    assert stats["top1_agreement"] == 0.75  # only the last row's argmax differs
    # Row 3's zero contributes nothing: 0.5 ln(0.5 / 0.6) + ~0.5 ln(~0.5 / 0.1).
    expected = 0.5 * math.log(0.5 / 0.6) + (0.5 - 1e-9) * math.log((0.5 - 1e-9) / 0.1)
    assert stats["kl_max"] == pytest.approx(expected, rel=1e-6)


def test_quality_stats_infinite_kl_when_test_rules_out_a_reference_token():
    ruled_out = np.array([[math.log(0.5), math.log(0.5), -np.inf]] * 3)
    ref = np.log(np.array([[0.4, 0.3, 0.3], [0.4, 0.3, 0.3], [0.5, 0.5, 1e-300]]))
    ref[2, 2] = -np.inf
    stats = quality_stats(ref, ruled_out)
    assert stats["kl_max"] == math.inf and stats["kl_mean"] == math.inf
    # Sorted KLs [0, inf, inf]: the p99 interpolates between two infs.
    assert stats["kl_p99"] == math.inf


def test_quality_stats_shape_mismatch():
    with pytest.raises(ValueError, match="shapes"):
        quality_stats(np.zeros((3, 4)), np.zeros((3, 5)))


def test_quality_is_passed_through_and_validated():
    stats = quality_stats(np.zeros((2, 3)), np.zeros((2, 3)))
    result = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, quality=stats)
    assert result["quality"] == stats
    with pytest.raises(ValueError, match="quality"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, quality={"kl": 0.0})


def test_energy_estimate_by_hand():
    profile = energy.HardwareProfile("toy", pj_per_flop=2.0, pj_per_byte_device=3.0,
                                     pj_per_byte_host=5.0, pj_per_byte_disk=7.0,
                                     idle_watts=10.0)
    # 1e12 FLOPs * 2 pJ = 2 J; 1e9 B * 3 pJ = 3 mJ; 2e9 B * 5 pJ = 10 mJ; 10 W * 10 s = 100 J.
    expected = 2.0 + 0.003 + 0.010 + 100.0
    joules = energy.estimate_energy_j(profile, 1e12, {"device": 1e9, "host": 2e9}, 10.0)
    assert joules == pytest.approx(expected)
    counters = {"flops": 1e12, "bytes_moved_device": 1e9, "bytes_moved_host": 2e9}
    result = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=10.0, counters=counters,
                             energy=profile)
    assert result["energy_j_est"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="flops"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, energy=profile)
    with pytest.raises(ValueError, match="tape"):
        energy.estimate_energy_j(profile, 0.0, {"tape": 1.0}, 1.0)


def test_energy_profiles_are_registered_and_ordered_sensibly():
    assert set(energy.PROFILES) == {"cpu", "h100", "h200", "tpu_v5e"}
    for profile in energy.PROFILES.values():
        # Moving a byte further away costs more; an accelerator FLOP is cheaper than a CPU one.
        assert (profile.pj_per_byte_device <= profile.pj_per_byte_host
                < profile.pj_per_byte_disk)
        assert profile.pj_per_flop <= energy.PROFILES["cpu"].pj_per_flop
    with pytest.raises(ValueError, match="a100"):
        energy.get_profile("a100")


def test_clock_config_and_env_are_recorded():
    result = compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, clock="simulated",
                             config={"name": "paged"}, env={"jax": "0.10.2"})
    assert result["clock"] == "simulated"
    assert result["config"] == {"name": "paged"} and result["env"] == {"jax": "0.10.2"}
    with pytest.raises(ValueError, match="wall"):
        compute_metrics([], slo_ttft_s=1, slo_tpot_s=1, duration_s=1, clock="wall")


def test_format_table_side_by_side():
    base = compute_metrics(timeline(), slo_ttft_s=0.5, slo_tpot_s=0.2, duration_s=10.0,
                           config={"name": "baseline"})
    other = compute_metrics(timeline()[:2], slo_ttft_s=0.5, slo_tpot_s=0.2, duration_s=10.0,
                            counters={"bytes_moved_host": 2048})
    table = metrics.format_table([base, other],
                                 columns=["ttft_p50_s", "goodput_req_s", "bytes_moved.host",
                                          "failed_requests"])
    lines = table.splitlines()
    assert lines[0] == "| run | ttft_p50_s | goodput_req_s | bytes_moved.host | failed_requests |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| baseline | 0.35 | 0.2 | - | 1 |"
    assert lines[3] == "| 1 | 0.35 | 0.1 | 2048 | 0 |"
    assert len(metrics.format_table([base]).splitlines()) == 3
    with pytest.raises(ValueError, match="ttft_p95"):
        metrics.format_table([base], columns=["ttft_p95_s"])
