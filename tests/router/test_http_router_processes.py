"""The HTTP router and two server replicas as processes on 127.0.0.1 (scripts/router.py,
scripts/serve.py on the tiny chat model saved as a checkpoint). Replicas take tens of seconds
to start, so these run in `make test-slow` (tests/slow_cases.txt);
tests/router/test_http_router.py covers the same semantics over fake replicas in the fast
suite.

Oracles: the replicas' own /metrics (prefix-cache hits and queries, finished requests by
reason), the official `openai` client, and the request ids each answer carries.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvjax.bench.router_http import (
    ScriptProcess,
    metric_sum,
    replica_processes,
    router_process,
    wait_healthy,
)
from kvjax.router.http import REPLICA_HEADER

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def replicas(replica_args):
    with replica_processes(replica_args, 2) as started:
        yield started


def hit_rate(urls, before):
    hits = sum(metric_sum(u, "kvjax:prefix_cache_hits_total") for u in urls) - before[0]
    queries = sum(metric_sum(u, "kvjax:prefix_cache_queries_total") for u in urls) - before[1]
    return hits / queries


def _complete(client: openai.OpenAI, model: str, prompt: list[int]):
    return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)


def test_prefix_affinity_raises_the_hit_rate_over_round_robin(replicas):
    urls = [url for url, _ in replicas]
    rates = {}
    for offset, policy in ((0, "round_robin"), (40, "prefix_affinity")):
        # 4 bursts of 6 requests, each burst opening with its own 4-page block.
        prompts = [[3 + offset + g] * 32 + [60 + g, 61 + i, 62, 63, 64]
                   for g in range(4) for i in range(6)]
        before = (sum(metric_sum(u, "kvjax:prefix_cache_hits_total") for u in urls),
                  sum(metric_sum(u, "kvjax:prefix_cache_queries_total") for u in urls))
        with router_process(urls, policy) as router:
            client = openai.OpenAI(base_url=router + "/v1", api_key="-", max_retries=0)
            model = client.models.list().data[0].id
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(functools.partial(_complete, client, model), prompts))
            # Chat, streamed and not, through the router: the same greedy text.
            chat = dict(model=model, messages=[dict(role="user", content="hi there")],
                        max_tokens=8, temperature=0)
            whole = client.chat.completions.create(**chat).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(**chat, stream=True)
                               if c.choices)
            assert streamed == whole
        assert all(a.usage.completion_tokens == 4 for a in answers)
        rates[policy] = hit_rate(urls, before)
    assert rates["prefix_affinity"] > rates["round_robin"] + 0.1, rates


def test_tenant_affinity_raises_the_hit_rate_over_round_robin(replicas):
    """3 tenants (each its own 4-page system prompt, sent as `user`) take turns, one request at
    a time: round robin over 2 replicas puts each tenant on both, prefix affinity finds the
    tenant's pages through the roots the replicas report per affinity key."""
    urls = [url for url, _ in replicas]
    rates, served = {}, {}
    for offset, policy in ((0, "round_robin"), (50, "prefix_affinity")):
        before = (sum(metric_sum(u, "kvjax:prefix_cache_hits_total") for u in urls),
                  sum(metric_sum(u, "kvjax:prefix_cache_queries_total") for u in urls))
        with router_process(urls, policy) as router:
            client = openai.OpenAI(base_url=router + "/v1", api_key="-", max_retries=0)
            model = client.models.list().data[0].id
            picks = []
            for i in range(18):
                tenant = i % 3
                prompt = [3 + offset + tenant] * 32 + [70 + i, 71, 72]
                raw = client.completions.with_raw_response.create(
                    model=model, prompt=prompt, max_tokens=2, temperature=0,
                    user=f"tenant-{tenant}")
                picks.append((tenant, raw.headers[REPLICA_HEADER]))
                time.sleep(0.3)  # a poll reports the pages before the tenant's next request
        rates[policy] = hit_rate(urls, before)
        served[policy] = {t: {r for u, r in picks if u == t} for t in range(3)}
    assert all(len(where) == 2 for where in served["round_robin"].values()), served
    assert all(len(where) == 1 for where in served["prefix_affinity"].values()), served
    assert rates["prefix_affinity"] > rates["round_robin"] + 0.05, rates


def _send(router: str, request_id: str, stream: bool, watched: str,
          streaming_there: threading.Event) -> dict:
    """One completion through the router; what the client saw. Sets `streaming_there` once a
    stream served by replica `watched` has its first event."""
    body = dict(prompt=[5, 6, 7, 8, 9, 10, 11, int(request_id.split("-")[1]) + 12],
                max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=stream)
    headers = {"X-Request-Id": request_id}
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(router + "/v1/completions", json=body, headers=headers)
            return dict(status=r.status_code, body=r.json(), replica=r.headers.get(
                REPLICA_HEADER))
        events = []
        with client.stream("POST", router + "/v1/completions", json=body,
                           headers=headers) as r:
            if r.headers.get(REPLICA_HEADER) == watched:  # sent after its first event
                streaming_there.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
            return dict(status=r.status_code, events=events,
                        replica=r.headers.get(REPLICA_HEADER))


def test_sigkill_under_load_loses_no_request_and_runs_none_twice(replicas, replica_args):
    (dead_url, dead), (live_url, _) = replicas
    done_before = metric_sum(live_url, "kvjax:request_success_total", finished_reason="length")
    with router_process([dead_url, live_url], "round_robin",
                        args=["--read_timeout_s=30"]) as router:  # its output on a failure
        streaming_there = threading.Event()
        ids = [f"load-{i}" for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            # Streamed and not, in pairs, so round robin gives each replica both kinds.
            futures = {rid: pool.submit(_send, router, rid, i // 2 % 2 == 0, dead_url,
                                        streaming_there)
                       for i, rid in enumerate(ids)}
            assert streaming_there.wait(60)
            dead.send_signal(signal.SIGKILL)
            results = {rid: f.result(timeout=120) for rid, f in futures.items()}
        metrics = httpx.get(router + "/metrics", timeout=60).text
        retries = counters_from(metrics, "kvjax:router_retries_total")
        broken = on_live = 0
        for rid, got in results.items():
            assert got["status"] == 200, (rid, got)
            if "body" in got:  # Not streamed: never lost, whichever replica it ran on.
                assert got["body"]["id"] == rid
                assert got["body"]["usage"]["completion_tokens"] == MAX_TOKENS
            else:  # Streamed: complete, or ended by an error event naming it.
                assert got["events"][-1] == "[DONE]"
                last = json.loads(got["events"][-2])
                if "error" in last:
                    assert rid in last["error"]["message"]
                    broken += 1
                    continue
                assert last["choices"][-1]["finish_reason"] == "length"
            on_live += got["replica"] == live_url
        # Every request answered as run on the live replica ran there exactly once to its end.
        done = metric_sum(live_url, "kvjax:request_success_total", finished_reason="length")
        assert done - done_before == on_live
        # The kill hit a stream with output and requests without (the non-streamed ones).
        assert broken >= 1 and retries >= 1
        # The dead replica left the rotation; restarted on its port, it comes back.
        assert rotation(router) == {dead_url: False, live_url: True}
        port = dead_url.rsplit(":", 1)[1]
        restarted = ScriptProcess("serve.py", [f"--port={port}", "--log_level=warning",
                                               *replica_args])
        try:
            wait_healthy(dead_url, restarted, 600)
            deadline = time.monotonic() + 60
            while not rotation(router)[dead_url]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            restarted.stop()


def rotation(router: str) -> dict[str, bool]:
    """Replica URL -> in the router's rotation (a generous timeout: the machine is busy)."""
    return httpx.get(router + "/health", timeout=60).json()["replicas"]


def counters_from(text: str, name: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)
