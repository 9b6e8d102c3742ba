"""The HTTP router over fake replicas (an httpx transport playing N servers): routing from
polled state, pass-through, retry and no-duplicate semantics, stream failures, timeouts and the
rotation. Fast: no model, no process; the router app is driven through httpx's ASGI transport
(which runs no lifespan, so tests poll explicitly).

Oracles: each fake records the requests it received and ran to completion; page hashes come
from `kvjax.memory.prefix_cache.hash_page` itself; Prometheus's parser reads /metrics.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvjax.memory.prefix_cache import hash_page, hash_root
from kvjax.router.http import REPLICA_HEADER, RouterConfig, build_router_app
from kvjax.router.replicas import DEFAULT_AFFINITY, InFlight, prompt_page_hashes
from kvjax.server import protocol
from kvjax.server.kv_state import affinity_key

PAGE = 4
ROOT = hash_root(b"fake-provenance")


class _Events(httpx.AsyncByteStream):
    """SSE events, then optionally a connection failure instead of the end."""

    def __init__(self, events: list[bytes], fail: bool):
        self.events, self.fail = events, fail

    async def __aiter__(self):
        for event in self.events:
            await asyncio.sleep(0)
            yield event
        if self.fail:
            raise httpx.RemoteProtocolError("peer closed connection")


class FakeReplica:
    """A kvjax server as the router sees it. `mode`: ok, die (the process dies on the next
    completion: before any output, or after `events_before_death` stream events), hang (never
    answers: the router's read timeout fires), error (400)."""

    def __init__(self, url: str):
        self.url = url
        self.mode = "ok"
        self.is_alive = True
        self.events_before_death = 0
        self.received: list[str] = []  # X-Request-Id of every completion request
        self.completed: list[str] = []  # ... of those it answered in full
        self.cached_prompts: list[list[int]] = []  # the default tenant's
        self.tenant_prompts: list[tuple[str, list[int]]] = []  # (affinity key, prompt)
        self.caches_served = False  # completed prompts join tenant_prompts
        self.num_served_with_pages = 0  # completions whose prompt pages it held on arrival
        self.metrics_hits = 0
        self.tokenized: list[dict] = []
        self.opens_with_role = False
        self.is_stalled = False  # the process stopped (SIGSTOP): nothing answers
        self.is_stepping = False  # its engine is in a long step: /kv_state waits

    def root(self, affinity: str) -> bytes:
        """Its chain root for an affinity key: a secret of this replica (salted by its URL)."""
        if affinity == DEFAULT_AFFINITY:
            return ROOT
        return hash_root(f"{self.url}|{affinity}".encode())

    def page_hashes(self, affinity: str, prompt: list[int]) -> list[str]:
        return prompt_page_hashes(prompt, self.root(affinity), PAGE)

    def kv_state(self) -> dict:
        cached = [(DEFAULT_AFFINITY, p) for p in self.cached_prompts] + self.tenant_prompts
        hashes = {h for a, p in cached for h in self.page_hashes(a, p)}
        # Each prompt served holds a page: the load a policy balances when no prefix decides.
        return dict(page_size=PAGE, num_pages=64, num_free_pages=64 - len(self.tenant_prompts),
                    num_running=0, num_waiting=0, queued_prefill_tokens=0,
                    prefix_root=ROOT.hex(), prefix_hashes=sorted(hashes),
                    prefix_roots={a: self.root(a).hex() for a, _ in self.tenant_prompts})

    def serve_prompt(self, request: httpx.Request, body: dict) -> None:
        """Counts whether it held the prompt's pages, then caches them (`caches_served`)."""
        if not self.caches_served:
            return
        affinity = affinity_key(request.headers.get("authorization"),
                                request.headers.get("x-tenant") or body.get("user"),
                                body.get("cache_salt"))
        held = set(self.kv_state()["prefix_hashes"])
        wanted = self.page_hashes(affinity, body["prompt"])
        self.num_served_with_pages += bool(wanted) and set(wanted) <= held
        self.tenant_prompts.append((affinity, body["prompt"]))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.is_alive:
            raise httpx.ConnectError("connection refused")
        path = request.url.path
        if path == "/health":
            if self.is_stalled:
                raise httpx.ReadTimeout("timed out")
            return httpx.Response(200, json={})
        if path == "/kv_state":
            if self.is_stepping:  # a long engine step holds the answer back
                raise httpx.ReadTimeout("timed out")
            return httpx.Response(200, json=self.kv_state())
        if path == "/metrics":
            return httpx.Response(200, text=(
                "# HELP kvjax:prefix_cache_hits_total Hits.\n"
                "# TYPE kvjax:prefix_cache_hits_total counter\n"
                f'kvjax:prefix_cache_hits_total{{model_name="m"}} {self.metrics_hits}\n'))
        if path == "/tokenize":  # one token per character, as a byte tokenizer would
            self.tokenized.append(json.loads(request.content))
            text = json.loads(request.content)["prompt"]
            return httpx.Response(200, json=dict(tokens=[ord(c) for c in text]))
        if path == "/v1/models":
            return httpx.Response(200, json=dict(object="list", data=[dict(id="m")]))
        request_id = request.headers["x-request-id"]
        self.received.append(request_id)
        body = json.loads(request.content)
        if self.mode == "error":
            return httpx.Response(400, json=protocol.error_body("max_tokens: too many"))
        if self.mode == "hang":
            await asyncio.sleep(request.extensions["timeout"]["read"])
            raise httpx.ReadTimeout("timed out")
        headers = {"x-request-id": request_id}
        if body.get("stream"):
            events = [f"data: {json.dumps(dict(id=request_id, n=i))}\n\n".encode()
                      for i in range(3)]
            if self.opens_with_role:  # as a chat stream does, before any token
                role = dict(id=request_id, choices=[dict(index=0, delta=dict(
                    role="assistant", content=""), logprobs=None, finish_reason=None)])
                events.insert(0, f"data: {json.dumps(role)}\n\n".encode())
            if self.mode == "die":
                self.is_alive = False
                return httpx.Response(200, headers={**headers, "content-type":
                                                    "text/event-stream"},
                                      stream=_Events(events[:self.events_before_death], True))
            self.completed.append(request_id)
            return httpx.Response(200, headers={**headers, "content-type": "text/event-stream"},
                                  stream=_Events([*events, b"data: [DONE]\n\n"], False))
        if self.mode == "die":
            self.is_alive = False
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if self.mode == "glitch":  # what the HTTP stack raised, unmapped, on a killed socket
            self.is_alive = False
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        self.completed.append(request_id)
        self.serve_prompt(request, body)
        return httpx.Response(200, headers=headers, json=dict(id=request_id, text=self.url))


class Fakes(httpx.AsyncBaseTransport):
    def __init__(self, n: int):
        self.replicas = [FakeReplica(f"http://replica{i}") for i in range(n)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        return await next(r for r in self.replicas if r.url == url).handle(request)


def run_router(num_replicas: int, scenario, *, policy: str = "round_robin",
               read_timeout_s: float = 5.0, clock=None, **config):
    """Runs `scenario(client, router, fakes)` against a router over fresh fakes."""
    fakes = Fakes(num_replicas)

    async def main():
        async with httpx.AsyncClient(transport=fakes) as upstream:
            router_config = RouterConfig(replicas=tuple(r.url for r in fakes.replicas),
                                         policy=policy, read_timeout_s=read_timeout_s, **config)
            app = build_router_app(router_config, client=upstream,
                                   **({} if clock is None else dict(clock=clock)))
            router = app.state.router
            await router.replicas.poll_once()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://router") as client:
                return await scenario(client, router, fakes.replicas)

    return asyncio.run(main())


def completion(client, request_id: str, *, stream: bool = False, prompt=(1, 2, 3)):
    return client.post("/v1/completions", headers={"x-request-id": request_id},
                       json=dict(model="m", prompt=list(prompt), max_tokens=4, stream=stream))


def test_round_robin_alternates_and_passes_answers_through():
    async def scenario(client, router, fakes):
        answers = [await completion(client, f"r{i}") for i in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert [a.json()["id"] for a in answers] == ["r0", "r1", "r2", "r3"]
        assert [a.headers[REPLICA_HEADER] for a in answers] == [
            fakes[0].url, fakes[1].url, fakes[0].url, fakes[1].url]
        models = await client.get("/v1/models")
        assert models.json()["data"][0]["id"] == "m"

    run_router(2, scenario)


def test_replica_error_comes_back_with_its_status_and_is_not_retried():
    async def scenario(client, router, fakes):
        fakes[0].mode = "error"
        answer = await completion(client, "bad")
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "max_tokens: too many"
        assert fakes[0].received == ["bad"] and fakes[1].received == []
        assert fakes[0].url in [r.url for r in router.replicas.healthy()]

    run_router(2, scenario)


def test_a_request_whose_replica_dies_before_answering_runs_once_elsewhere_with_its_id():
    async def scenario(client, router, fakes):
        fakes[0].mode = "die"
        answer = await completion(client, "req-1")
        assert answer.status_code == 200
        assert answer.json()["id"] == "req-1"
        assert answer.headers[REPLICA_HEADER] == fakes[1].url
        assert fakes[0].received == ["req-1"] and fakes[0].completed == []
        assert fakes[1].received == ["req-1"] and fakes[1].completed == ["req-1"]
        # The dead replica left the rotation: every later request goes to the live one.
        for i in range(3):
            assert (await completion(client, f"after-{i}")).headers[REPLICA_HEADER] == \
                fakes[1].url
        assert fakes[0].received == ["req-1"]
        # It comes back once a poll finds it healthy.
        fakes[0].mode, fakes[0].is_alive = "ok", True
        await router.replicas.poll_once()
        urls = {(await completion(client, f"back-{i}")).headers[REPLICA_HEADER]
                for i in range(2)}
        assert urls == {fakes[0].url, fakes[1].url}

    run_router(2, scenario)


def test_an_unmapped_failure_before_any_answer_is_retried_like_a_dead_connection():
    async def scenario(client, router, fakes):
        fakes[0].mode = "glitch"
        answer = await completion(client, "g-1")
        assert answer.status_code == 200 and answer.json()["id"] == "g-1"
        assert fakes[1].completed == ["g-1"]

    run_router(2, scenario)


def test_a_request_is_retried_at_most_once():
    async def scenario(client, router, fakes):
        for fake in fakes:
            fake.mode = "die"
        answer = await completion(client, "doomed")
        assert answer.status_code == 503
        assert "doomed" in answer.json()["error"]["message"]
        assert sorted(len(f.received) for f in fakes) == [0, 1, 1]

    run_router(3, scenario)


def test_a_stream_that_dies_before_its_first_event_is_retried():
    async def scenario(client, router, fakes):
        fakes[0].mode = "die"
        answer = await completion(client, "s-1", stream=True)
        events = [e for e in answer.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert [json.loads(e.removeprefix("data: "))["n"] for e in events[:-1]] == [0, 1, 2]
        assert fakes[1].completed == ["s-1"]

    run_router(2, scenario)


def test_a_chat_stream_that_dies_after_its_role_event_only_is_retried():
    async def scenario(client, router, fakes):
        for fake in fakes:
            fake.opens_with_role = True
        fakes[0].mode, fakes[0].events_before_death = "die", 1  # the role event, then death
        answer = await completion(client, "c-1", stream=True)
        events = [json.loads(e.removeprefix("data: ")) for e in answer.text.split("\n\n")
                  if e and e != "data: [DONE]"]
        assert "choices" in events[0]  # one role event: the second replica's
        assert [e.get("n") for e in events[1:]] == [0, 1, 2]
        assert fakes[1].completed == ["c-1"]

    run_router(2, scenario)


def test_a_stream_that_dies_after_output_ends_with_an_error_event_and_is_not_rerun():
    async def scenario(client, router, fakes):
        fakes[0].mode, fakes[0].events_before_death = "die", 2
        answer = await completion(client, "s-2", stream=True)
        assert answer.status_code == 200
        events = [json.loads(e.removeprefix("data: ")) for e in answer.text.split("\n\n")
                  if e and e != "data: [DONE]"]
        assert [e.get("n") for e in events[:2]] == [0, 1]
        assert "s-2" in events[2]["error"]["message"]
        assert answer.text.endswith("data: [DONE]\n\n")
        assert fakes[1].received == []  # It produced output: never run again.
        assert router.replicas.healthy() == [router.replicas.replicas[1]]

    run_router(2, scenario)


def test_a_silent_replica_gets_504_within_the_timeout_and_no_retry():
    async def scenario(client, router, fakes):
        fakes[0].mode = "hang"
        answer = await asyncio.wait_for(completion(client, "slow"), timeout=5)
        assert answer.status_code == 504
        assert fakes[1].received == []

    run_router(2, scenario, read_timeout_s=0.2)


def test_a_busy_replica_stays_in_rotation_and_a_stalled_one_leaves_after_missed_polls():
    async def scenario(client, router, fakes):
        state = router.replicas.replicas[0].state
        fakes[0].cached_prompts.append(list(range(40)))
        fakes[0].is_stepping = True
        await router.replicas.poll_once()
        assert len(router.replicas.healthy()) == 2
        assert router.replicas.replicas[0].state is state  # the last state, kept
        fakes[0].is_stalled = True
        for _ in range(router.replicas.max_missed_polls - 1):
            await router.replicas.poll_once()
            assert len(router.replicas.healthy()) == 2
        await router.replicas.poll_once()
        assert router.replicas.healthy() == [router.replicas.replicas[1]]
        fakes[0].is_stalled = fakes[0].is_stepping = False
        await router.replicas.poll_once()
        assert len(router.replicas.healthy()) == 2
        assert router.replicas.replicas[0].state.prefix_hashes  # fresh again

    run_router(2, scenario)


def test_no_healthy_replica_is_503_and_health_says_so():
    async def scenario(client, router, fakes):
        for fake in fakes:
            fake.is_alive = False
        await router.replicas.poll_once()
        assert (await client.get("/health")).status_code == 503
        answer = await completion(client, "none")
        assert answer.status_code == 503
        assert "none" in answer.json()["error"]["message"]

    run_router(2, scenario)


def test_prefix_affinity_follows_the_replica_holding_the_prompt_pages():
    shared = list(range(10, 30))  # 5 full pages

    async def scenario(client, router, fakes):
        fakes[2].cached_prompts.append(shared + [99])
        await router.replicas.poll_once()
        # The prompt's chain, computed here with the prefix cache's own hash, is what the
        # replica reported.
        parent, chain = ROOT, []
        for start in range(0, 16, PAGE):
            parent = hash_page(parent, shared[start:start + PAGE])
            chain.append(parent[:8].hex())
        assert chain == prompt_page_hashes(shared + [7], ROOT, PAGE)[:4]
        picks = [(await completion(client, f"p{i}", prompt=shared + [i])).headers[
            REPLICA_HEADER] for i in range(3)]
        assert picks == [fakes[2].url] * 3
        # A request the router sent and that has not ended counts as computing its pages.
        fresh = list(range(50, 70))
        replica = router.replicas.replicas[0]
        assert replica.instance_state(replica.prompt_hashes(fresh + [2])).prefix_tokens == 0
        replica.in_flight["running"] = InFlight(30, replica.prompt_hashes(fresh + [1]))
        state = replica.instance_state(replica.prompt_hashes(fresh + [2]))
        assert (state.prefix_tokens, state.num_seqs, state.num_tokens) == (20, 1, 30)

    run_router(3, scenario, policy="prefix_affinity")


def test_prefix_affinity_tokenizes_text_prompts():
    text = "the same long system prompt, then a question"

    async def scenario(client, router, fakes):
        fakes[1].cached_prompts.append([ord(c) for c in text])
        await router.replicas.poll_once()
        body = dict(model="m", prompt=text + "?", max_tokens=4)
        picks = [(await client.post("/v1/completions", json=body)).headers[REPLICA_HEADER]
                 for _ in range(2)]
        assert picks == [fakes[1].url] * 2
        assert {"prompt": text + "?", "model": "m"} in fakes[0].tokenized + fakes[1].tokenized
        # Ids no tokenizer makes name no cached page; the replica refuses them, not the router.
        answer = await client.post("/v1/completions", json=dict(body, prompt=[2**70, -1]))
        assert answer.status_code == 200

    run_router(2, scenario, policy="prefix_affinity")


def test_a_tenants_requests_follow_its_pages_not_another_tenants_equal_tokens():
    system = list(range(10, 30))  # 5 full pages

    async def scenario(client, router, fakes):
        alice = affinity_key(None, "alice", None)
        salted = affinity_key("Bearer k1", None, "team")
        fakes[0].cached_prompts.append(system + [1])  # the default tenant's: not alice's
        fakes[1].tenant_prompts.append((alice, system + [1]))
        fakes[2].tenant_prompts.append((salted, system + [1]))
        await router.replicas.poll_once()

        async def pick(i, **kwargs):
            body = dict(model="m", prompt=system + [i], max_tokens=4)
            answer = await client.post("/v1/completions", json={**body, **kwargs.pop("body", {})},
                                       **kwargs)
            return answer.headers[REPLICA_HEADER]

        assert [await pick(i, body=dict(user="alice")) for i in range(2)] == [fakes[1].url] * 2
        assert await pick(2, headers={"x-tenant": "alice"}) == fakes[1].url
        assert await pick(3, headers={"authorization": "Bearer k1"},
                          body=dict(cache_salt="team")) == fakes[2].url
        assert await pick(4) == fakes[0].url
        # A tenant no replica has reported: its requests in flight attract its next ones.
        replica = router.replicas.replicas[1]
        bob, carol = affinity_key(None, "bob", None), affinity_key(None, "carol", None)
        assert replica.instance_state(replica.prompt_hashes(system + [5], bob)).prefix_tokens \
            == 0
        replica.in_flight["bob-running"] = InFlight(30, replica.prompt_hashes(system + [6], bob))
        assert replica.instance_state(replica.prompt_hashes(system + [5], bob)).prefix_tokens \
            == 20
        assert replica.instance_state(
            replica.prompt_hashes(system + [5], carol)).prefix_tokens == 0

    run_router(3, scenario, policy="prefix_affinity")


@pytest.mark.parametrize("policy", ["prefix_affinity", "load_aware"])
def test_tenant_aware_affinity_raises_the_hit_rate_over_round_robin(policy):
    """4 tenants, each opening every prompt with its own 4-page system prompt, over 3 replicas
    that cache what they serve under their own secret roots. Oracle: each fake's count of
    requests whose prompt pages it held on arrival (brute force over what it served)."""
    systems = [[20 + 5 * t + j for j in range(5)] * 4 for t in range(4)]
    requests = [(f"tenant-{i % 4}", systems[i % 4] + [100 + i]) for i in range(24)]

    def hits(policy_name):
        async def scenario(client, router, fakes):
            for fake in fakes:
                fake.caches_served = True
            for tenant, prompt in requests:
                answer = await client.post("/v1/completions", headers={"x-tenant": tenant},
                                           json=dict(model="m", prompt=prompt, max_tokens=4))
                assert answer.status_code == 200, answer.text
                await router.replicas.poll_once()
            return sum(f.num_served_with_pages for f in fakes)

        return run_router(3, scenario, policy=policy_name)

    # Round robin: 3 replicas hold no copy of a tenant's pages until each served it once.
    assert hits("round_robin") == 24 - 4 * 3
    assert hits(policy) == 24 - 4


@pytest.mark.parametrize("policy", ["round_robin", "prefix_affinity"])
def test_alternating_phases_send_new_requests_to_the_replica_in_its_window(policy):
    now = [0.0]
    shared = list(range(10, 30))

    async def scenario(client, router, fakes):
        fakes[2].cached_prompts.append(shared + [1])  # affinity alone would pick replica 2
        await router.replicas.poll_once()
        picks = []
        for t in (0.5, 0.9, 1.5, 2.5, 3.2, 8.9):  # windows of 1 s, replicas 0, 1, 2 in turn
            now[0] = t
            picks.append((await completion(client, f"r{t}", prompt=shared + [2])).headers[
                REPLICA_HEADER])
        assert picks == [fakes[i].url for i in (0, 0, 1, 2, 0, 2)]
        # A window whose replica is down falls back to the others, as the policy picks.
        fakes[1].is_alive = False
        await router.replicas.poll_once()
        now[0] = 1.5
        answer = await completion(client, "in-a-dead-window", prompt=shared + [3])
        assert answer.status_code == 200
        assert answer.headers[REPLICA_HEADER] != fakes[1].url

    run_router(3, scenario, policy=policy, phase_period_s=3.0, clock=lambda: now[0])


def test_metrics_label_each_replica_and_sum_counters():
    async def scenario(client, router, fakes):
        fakes[0].metrics_hits, fakes[1].metrics_hits = 3, 4
        fakes[0].mode = "die"
        await completion(client, "m-1")
        text = (await client.get("/metrics")).text
        samples = {(s.name, s.labels.get("replica"), s.labels.get("outcome")): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        # fakes[0] died: only the live replica's series, and the sum over what was read.
        assert samples[("kvjax:prefix_cache_hits_total", fakes[1].url, None)] == 4
        assert samples[("kvjax:prefix_cache_hits_total", "all", None)] == 4
        assert ("kvjax:prefix_cache_hits_total", fakes[0].url, None) not in samples
        assert samples[("kvjax:router_retries_total", None, None)] == 1
        assert samples[("kvjax:router_requests_total", fakes[0].url,
                        "failed_before_output")] == 1
        assert samples[("kvjax:router_requests_total", fakes[1].url, "200")] == 1
        assert samples[("kvjax:router_replica_up", fakes[0].url, None)] == 0
        fakes[0].mode, fakes[0].is_alive = "ok", True
        await router.replicas.poll_once()
        text = (await client.get("/metrics")).text
        sums = [s.value for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kvjax:prefix_cache_hits_total" and s.labels["replica"] == "all"]
        assert sums == [7]

    run_router(2, scenario)


@pytest.mark.parametrize("field", ["poll_interval_s", "read_timeout_s"])
def test_bad_config_is_refused(field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(replicas=("http://a:1",), **{field: 0})
    with pytest.raises(ValueError, match="routing policy"):
        RouterConfig(replicas=("http://a:1",), policy="nope")
    with pytest.raises(ValueError, match="phase_period_s"):
        RouterConfig(replicas=("http://a:1",), phase_period_s=0.0)
    with pytest.raises(ValueError, match="exclude each other"):
        RouterConfig(replicas=("http://a:1",), prefill_replicas=("http://b:1",),
                     phase_period_s=2.0)
