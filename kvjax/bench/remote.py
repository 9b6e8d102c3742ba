"""serve_bench over HTTP: the same workloads and metrics against any OpenAI-compatible server.

    result = run_http_benchmark_detailed(load_config("configs/serve_demo.py"),
                                         "http://127.0.0.1:8000")

Each request of the workload is sent when the wall clock passes its arrival time, from a
thread of its own, as a streaming `POST /v1/completions` with the prompt's token ids,
`max_tokens`, `n`, the config's temperature, `ignore_eos` (so every run generates the same
tokens) and `stream_options.include_usage`; its tenant goes in `user` and its priority in an
`X-Priority` header. Timings are client-side: TTFT from the request's arrival time to the
first streamed chunk carrying its sample, the finish time at the sample's last chunk, the
output token count from the usage chunk (split evenly over n samples, exact with ignore_eos).
A refusal (429, 4xx, 5xx, a broken connection) is a failed request.

Counters that only the server knows (prefix-cache hits and queries, preemptions, KV bytes
moved to host and disk, programs compiled) come from the difference of two `/metrics`
scrapes when the target is a kvjax server; for another server they are None, as are the
device bytes, the KV utilization, the energy estimate and the quality columns.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from ml_collections import ConfigDict
from tqdm import tqdm

from kvjax.bench.metrics import RequestRecord, compute_metrics
from kvjax.bench.runner import BenchResult, build_workload, check_supported, environment
from kvjax.bench.workloads import BenchRequest, Tokenizer
from kvjax.models.loading import load_model
from kvjax.router.http_metrics import ALL_REPLICAS

# /metrics sample -> serve_bench counter; summed over labels (e.g. the kv_bytes_moved tiers).
_COUNTERS = {
    "kvjax:prefix_cache_hits_total": "prefix_hit_tokens",
    "kvjax:prefix_cache_queries_total": "prefix_query_tokens",
    "kvjax:num_preemptions_total": "preemptions",
    "kvjax:num_compiles": "compiles_after_warmup",  # a gauge: the run's difference counts
}
_TIERS = {"host": "bytes_moved_host", "disk": "bytes_moved_disk"}


class _Target:
    """An OpenAI-compatible server at a base URL (http only: loopback or a trusted network)."""

    def __init__(self, url: str, timeout_s: float):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--target must be http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def get(self, path: str) -> tuple[int, str]:
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path)
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    def model_id(self) -> str:
        status, body = self.get("/v1/models")
        if status != 200:
            raise ValueError(f"GET /v1/models answered {status}: {body[:200]}")
        return json.loads(body)["data"][0]["id"]

    def counters(self) -> dict[str, float] | None:
        """kvjax's server counters, or None when the target exports none of them."""
        status, text = self.get("/metrics")
        if status != 200:
            return None
        from prometheus_client.parser import text_string_to_metric_families

        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("replica") == ALL_REPLICAS:
                    continue  # A router's sum over its replicas, whose own series follow.
                if s.name in _COUNTERS:
                    key = _COUNTERS[s.name]
                elif s.name == "kvjax:kv_bytes_moved_total" and s.labels.get("tier") in _TIERS:
                    key = _TIERS[s.labels["tier"]]
                else:
                    continue
                found[key] = found.get(key, 0.0) + s.value
        return found or None


def _send(target: _Target, model: str, request: BenchRequest, temperature: float,
          origin: float) -> list[RequestRecord]:
    """Streams one request; one record per sample, times relative to `origin`."""
    body = dict(model=model, prompt=list(request.prompt_ids), max_tokens=request.max_new_tokens,
                n=request.n, temperature=temperature, ignore_eos=True, stream=True,
                stream_options=dict(include_usage=True))
    headers = {"Content-Type": "application/json"}
    if request.tenant is not None:
        body["user"] = request.tenant
    if request.priority:
        headers["X-Priority"] = str(request.priority)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    usage = None
    conn = target.connect()
    try:
        conn.request("POST", target.prefix + "/v1/completions", body=json.dumps(body),
                     headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            return _failed(request, f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter() - origin
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return _failed(request, f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                first.setdefault(choice["index"], now)
                last[choice["index"]] = now
            usage = chunk.get("usage") or usage
    except (OSError, http.client.HTTPException, ValueError) as e:
        return _failed(request, f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    tokens = usage["completion_tokens"] // request.n if usage else None
    if tokens is None or len(first) != request.n:
        return _failed(request, f"incomplete stream: {len(first)} of {request.n} samples, "
                       f"usage {usage}")
    return [RequestRecord(
        request_id=request.request_id if request.n == 1 else f"{request.request_id}#{i}",
        tenant=request.tenant, arrival_time=request.arrival_time, first_token_time=first[i],
        token_times=[], finish_time=last[i], num_prompt_tokens=len(request.prompt_ids),
        num_output_tokens=tokens, error=None,
        num_cached_prompt_tokens=usage.get("prompt_tokens_details", {}).get(
            "cached_tokens", 0) if request.n == 1 else 0) for i in range(request.n)]


def _failed(request: BenchRequest, error: str) -> list[RequestRecord]:
    return [RequestRecord(
        request_id=request.request_id, tenant=request.tenant, arrival_time=request.arrival_time,
        first_token_time=None, token_times=[], finish_time=request.arrival_time,
        num_prompt_tokens=len(request.prompt_ids), num_output_tokens=0, error=error)]


def replay(target: str, requests: Sequence[BenchRequest], *, model: str | None = None,
           temperature: float = 0.0, timeout_s: float = 600.0, progress: bool = False
           ) -> tuple[list[RequestRecord], float]:
    """Sends `requests` at their arrival times; returns the records and the run's duration."""
    server = _Target(target, timeout_s)
    model = model or server.model_id()
    records: list[RequestRecord] = []
    lock = threading.Lock()
    bar = tqdm(total=len(requests), desc=target, unit="req", disable=not progress)
    origin = time.perf_counter()

    def run(request: BenchRequest) -> None:
        time.sleep(max(0.0, request.arrival_time - (time.perf_counter() - origin)))
        got = _send(server, model, request, temperature, origin)
        with lock:
            records.extend(got)
            bar.update()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return records, time.perf_counter() - origin


def run_http_benchmark_detailed(config: ConfigDict, target: str, *,
                                tokenizer: Tokenizer | None = None,
                                requests: Sequence[BenchRequest] | None = None,
                                model: str | None = None, progress: bool = False
                                ) -> BenchResult:
    """Replays `config`'s workload against the server at `target` (see the module docstring).

    Args:
        config: a benchmark config; its engine, kv and tiers sections describe the server
            only if the server was started with them (scripts/serve.py --config=...).
        target: the server's base URL, http://HOST:PORT.
        tokenizer: builds the workload's prompts; None loads `config.model`'s.
        requests: the workload; None builds `config.workload`.
        model: the `model` field to send; None asks the server's /v1/models.
        progress: show a tqdm bar of requests done.
    """
    check_supported(config)
    if requests is None:
        if tokenizer is None:
            tokenizer = load_model(config.model.name, dtype=config.model.dtype).tokenizer
        requests = build_workload(config, tokenizer)
    requests = sorted(requests, key=lambda r: r.arrival_time)
    server = _Target(target, 600.0)
    before = server.counters()
    records, duration_s = replay(target, requests, model=model,
                                 temperature=float(config.sampling.temperature),
                                 progress=progress)
    after = server.counters()
    counters = None
    if before is not None and after is not None:
        counters = {k: after[k] - before.get(k, 0.0) for k in after}
    echoed = dict(config.to_dict(), target=target)
    echoed.pop("sweep", None)
    metrics = compute_metrics(
        records, slo_ttft_s=float(config.slo.ttft_s), slo_tpot_s=float(config.slo.tpot_s),
        duration_s=max(duration_s, 1e-9), counters=counters, config=echoed,
        env=dict(environment(), target=target), clock="real")
    if metrics["bytes_moved"] is not None:
        metrics["bytes_moved"]["device"] = None  # The server exports no device traffic.
    return BenchResult(metrics=metrics, records=records, kv_samples=[], steps=[])


def run_http_benchmark(config: ConfigDict, target: str, **kwargs: Any) -> dict[str, Any]:
    """`run_http_benchmark_detailed(config, target, **kwargs).metrics`."""
    return run_http_benchmark_detailed(config, target, **kwargs).metrics


def http_overhead(model, engine_config, *, num_requests: int = 100, max_tokens: int = 4
                  ) -> dict[str, Any]:
    """The fixed cost of a request over HTTP: median seconds of `num_requests` sequential
    `max_tokens`-token greedy requests in-process (`Engine.generate`) and through a
    `kvjax.server` on loopback (blocking and streaming), on two warmed-up engines of one
    config. Use a model whose step is short (the tiny test model), so the difference is the
    server's own cost: parsing, the hop to the engine thread and back, the response."""
    import statistics

    import httpx

    from kvjax.engine.engine import Engine
    from kvjax.sampling import SamplingParams
    from kvjax.server import BackgroundServer, ServerConfig

    def prompt(i: int) -> list[int]:
        return [5, 6, 7, 1 + i % (model.config.vocab_size - 1)]

    def median_s(call) -> float:
        times = []
        for i in range(num_requests):
            start = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    engine = Engine(model, engine_config)
    engine.warmup()
    sampling = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    result = dict(num_requests=num_requests, max_tokens=max_tokens,
                  in_process_s=median_s(lambda i: engine.generate([prompt(i)], sampling)))
    served = Engine(model, engine_config)
    served.warmup()
    with BackgroundServer(served, ServerConfig(model_name="overhead")) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        for key, stream in (("http_s", False), ("http_stream_s", True)):
            result[key] = median_s(lambda i, stream=stream: client.post(
                "/v1/completions", json=dict(prompt=prompt(i), max_tokens=max_tokens,
                                             temperature=0, ignore_eos=True,
                                             stream=stream)).read())
    result["overhead_s"] = result["http_s"] - result["in_process_s"]
    result["env"] = environment()
    return result
