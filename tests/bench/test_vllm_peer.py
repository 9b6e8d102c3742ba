"""Tests of the vLLM peer's pure parts: client workloads, result parsing, identical outputs and
the table. vLLM itself is not needed (scripts/vllm_peer.py runs it in its own venv)."""

import sys
import time

import pytest

from kvjax.bench import vllm_peer
from kvjax.bench.router_http import LoggedProcess


def _result(throughput, ttft_ms, tpot_ms, texts, errors=None):
    return dict(completed=len(texts) - sum(map(bool, errors or [])),
                output_throughput=throughput, median_ttft_ms=ttft_ms, p99_ttft_ms=2 * ttft_ms,
                median_tpot_ms=tpot_ms, p99_tpot_ms=2 * tpot_ms, generated_texts=texts,
                errors=errors or [""] * len(texts))


def _flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_client_args_make_each_workload_on_the_same_prompts():
    config = vllm_peer.PeerConfig(num_prompts=16)
    made = {w: vllm_peer.client_args(w, config, base_url="http://h:1", tokenizer="tok",
                                     result_dir="out", result_filename=f"{w}.json")
            for w in vllm_peer.WORKLOADS}
    assert _flag(made["random"], "--random-prefix-len") is None
    assert _flag(made["random"], "--request-rate") is None
    assert _flag(made["shared_prefix_512"], "--random-prefix-len") == "512"
    assert _flag(made["poisson_1rps"], "--request-rate") == "1"
    for args in made.values():
        # Same seed, sizes and greedy decoding for every workload and both servers; outputs
        # saved for the identical-output count.
        assert (_flag(args, "--seed"), _flag(args, "--num-prompts"),
                _flag(args, "--temperature")) == ("0", "16", "0")
        assert {"--ignore-eos", "--save-detailed"} <= set(args)
    with pytest.raises(ValueError, match="sharegpt"):
        vllm_peer.client_args("sharegpt", config, base_url="", tokenizer="", result_dir="",
                              result_filename="")


def test_servers_get_the_same_limits():
    config = vllm_peer.PeerConfig(max_num_seqs=8, max_model_len=900, kv_budget_gib=2)
    vllm = vllm_peer.vllm_server_argv("py", "hf", "bfloat16", 9, config)
    kvjax = vllm_peer.kvjax_server_args("bfloat16", 9, config)
    assert (_flag(vllm, "--dtype"), _flag(vllm, "--max-num-seqs"),
            _flag(vllm, "--max-model-len")) == ("bfloat16", "8", "900")
    assert {"--dtype=bfloat16", "--max_num_seqs=8", "--max_model_len=900",
            "--kv_budget_mb=2048"} <= set(kvjax)
    assert vllm_peer.vllm_server_env(config)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_a_swept_setting_follows_the_defaults_and_an_unknown_server_is_refused():
    config = vllm_peer.PeerConfig(kvjax_args=("--max_prefill_chunk=512",))
    args = vllm_peer.kvjax_server_args("float32", 9, config)
    assert args[-1] == "--max_prefill_chunk=512"  # absl keeps a repeated flag's last value
    with pytest.raises(ValueError, match="'sglang'"):
        vllm_peer.run_peer(config, servers=("sglang",), out_dir="unused")


def test_summarize_counts_failures_and_refuses_results_without_outputs():
    summary = vllm_peer.summarize(_result(100.0, 500.0, 50.0, ["a", ""], ["", "timeout"]))
    assert (summary["completed"], summary["failed"], summary["p99_ttft_ms"]) == (1, 1, 1000.0)
    result = _result(100.0, 500.0, 50.0, ["a"])
    del result["generated_texts"]
    with pytest.raises(ValueError, match="generated_texts"):
        vllm_peer.summarize(result)


def test_count_identical_matches_request_by_request():
    a, b = ["x", "y", "z", "w"], ["x", "Y", "z", "w"]
    assert vllm_peer.count_identical(a, b) == (3, 4)
    # A failed request is never identical, even when both texts are empty.
    assert vllm_peer.count_identical(["", "y"], ["", "y"], errors_a=["boom", ""]) == (1, 2)
    with pytest.raises(ValueError, match="not the same prompts"):
        vllm_peer.count_identical(a, b[:3])


def test_comparison_ratios_are_kvjax_over_vllm_and_a_missing_server_is_shown():
    runs = {("float32", "random", "vllm"): dict(vllm_peer.summarize(
                _result(100.0, 400.0, 50.0, ["a", "b"])), ready_s=60.0),
            ("float32", "random", "kvjax"): dict(vllm_peer.summarize(
                _result(150.0, 200.0, 75.0, ["a", "c"])), ready_s=15.0),
            ("bfloat16", "random", "vllm"): dict(vllm_peer.summarize(
                _result(300.0, 100.0, 20.0, ["a", "b"])), ready_s=70.0),
            ("bfloat16", "random", "kvjax"): dict(error="server: no /health after 600 s")}
    rows = vllm_peer.comparison(runs)
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    f32, bf16 = rows
    assert f32["ratios"]["output_throughput"] == pytest.approx(1.5)
    assert f32["ratios"]["median_ttft_ms"] == pytest.approx(0.5)
    assert f32["ratios"]["median_tpot_ms"] == pytest.approx(1.5)
    assert (f32["identical"], f32["total"]) == (1, 2)
    assert bf16["ratios"] is None and bf16["identical"] is None
    assert "generated_texts" not in f32["vllm"]
    text = vllm_peer.table(rows)
    assert "| float32 | random | kvjax/vLLM | | | 1.50 | 0.50 / 0.50 | 1.50 / 1.50 | |" in text
    assert "| 1/2 |" in text
    assert "bfloat16 random kvjax: server: no /health after 600 s" in text


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_server_group_ends_its_worker_processes():
    # vLLM's server starts engine processes; one that outlived a run would hold the cores and
    # the port through the next server's run. This worker even ignores SIGTERM.
    worker = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "time.sleep(60)")
    server = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
              "print(p.pid, flush=True); time.sleep(60)")
    process = LoggedProcess([sys.executable, "-c", server], own_group=True, grace_s=0.5)
    deadline = time.monotonic() + 30
    while not process.output_tail().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker_pid = int(process.output_tail())
    assert _alive(worker_pid)
    process.stop()
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)
