"""Prefill/decode disaggregation over HTTP: two real servers, the router app in-process.

Oracles: the dense greedy reference (`greedy_reference`, no KV cache) and a colocated
server's answer to the same request for tokens and text; page arithmetic for what the decode
replica found cached (every full page of the prompt but the one holding its last token) and
for the KV bytes the router counted (2 * L * P * K * D * itemsize per page).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest

from kvjax import Engine, EngineConfig
from kvjax.router.http import REPLICA_HEADER, RouterConfig, build_router_app
from kvjax.server import BackgroundServer, ServerConfig
from kvjax.server.pd import IMPORTED_TOKENS_HEADER, decode_frame
from kvjax.testing import greedy_reference, tiny_chat_model

PAGE = 8
EOS = 127
MAX_NEW = 6
CONFIG = EngineConfig(page_size=PAGE, num_pages=64, max_num_seqs=2, max_num_batched_tokens=64,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def servers(model):
    """A prefill replica and a decode replica."""
    started = []
    try:
        for _ in range(2):
            engine = Engine(model, CONFIG)
            server = BackgroundServer(engine, ServerConfig(model_name="tiny")).start()
            server.engine = engine
            started.append(server)
        yield started
    finally:
        for server in started:
            server.shutdown()


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def run_router(prefill: list[str], decode: list[str], scenario, *, dead_first: bool = False):
    """Runs `scenario(client, router)` against the router app; with `dead_first`, a prefill
    replica that died after the last poll (still in the rotation) comes first."""

    async def main():
        dead = [_dead_url()] if dead_first else []
        config = RouterConfig(replicas=tuple(decode), prefill_replicas=tuple(dead + prefill),
                              read_timeout_s=60)
        async with httpx.AsyncClient() as upstream:
            app = build_router_app(config, client=upstream)
            router = app.state.router
            for replicas in router.replica_sets():
                await replicas.poll_once()
            for replica in router.prefill_replicas.replicas[:len(dead)]:
                replica.is_healthy = True
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://router", timeout=60) as client:
                return await scenario(client, router)

    return asyncio.run(main())


def _tokens(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


def test_transfers_compile_nothing_after_the_first_request(servers, model):
    prefill, decode = servers

    def num_compiles() -> int:
        exporter = prefill.app.state.pd.exporters[None]
        importer = decode.app.state.pd.importers[None]
        return exporter.num_compiles + importer.num_compiles

    async def scenario(client, router):
        counts = []
        for n in (9, 17, 33, 45):  # 1, 2, 4 and 5 full pages: every padded count to 8
            prompt = [(5 * n + 7 * j) % 120 + 3 for j in range(n)]
            answer = await client.post("/v1/completions", json=dict(
                model="tiny", prompt=prompt, max_tokens=2, temperature=0))
            assert answer.status_code == 200, answer.text
            counts.append(num_compiles())
        return counts

    # First in the module: no request has compiled a transfer program before it.
    counts = run_router([prefill.base_url], [decode.base_url], scenario)
    assert counts == [counts[0]] * 4


def test_pd_answers_as_colocated_and_the_decode_replica_hits_the_imported_pages(servers,
                                                                              model):
    prefill, decode = servers
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 120, size=n)]
               for i, n in enumerate((29, 12, 5))]
    colocated = httpx.Client(base_url=prefill.base_url, timeout=60)

    async def scenario(client, router):
        answers = []
        for i, prompt in enumerate(prompts):
            body = dict(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
            answers.append(await client.post("/v1/completions", json=body,
                                             headers={"x-request-id": f"pd-{i}"}))
        stream = await client.post("/v1/completions", json=dict(
            model="tiny", prompt=prompts[0], max_tokens=MAX_NEW, temperature=0, stream=True))
        metrics = (await client.get("/metrics")).text
        return answers, stream, metrics

    answers, stream, metrics = run_router([prefill.base_url], [decode.base_url], scenario)
    # Each import's pin is released once its request ended (the pages stay cached, evictable).
    pins = [f"pd-{i}#import" for i in range(len(prompts))]
    deadline = time.monotonic() + 10
    while any(decode.engine.allocator.has_sequence(p) for p in pins):
        assert time.monotonic() < deadline, "an imported prefix stayed pinned"
        time.sleep(0.02)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.headers[REPLICA_HEADER] == decode.base_url
        tokens = greedy_reference(model, prompt, MAX_NEW, stop=(EOS,))
        got = answer.json()
        assert got["choices"][0]["text"] == model.tokenizer.decode(tokens)
        same = colocated.post("/v1/completions", json=dict(
            model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)).json()
        assert got["choices"] == same["choices"]
        assert got["usage"]["completion_tokens"] == same["usage"]["completion_tokens"]
        # The decode replica computed only from the page holding the prompt's last token.
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            (len(prompt) - 1) // PAGE * PAGE
        assert int(answer.headers[IMPORTED_TOKENS_HEADER]) == len(prompt) // PAGE * PAGE
    events = [line.removeprefix("data: ") for line in stream.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == answers[0].json()["choices"][0]["text"]
    c = model.config
    page_bytes = 2 * c.num_layers * PAGE * c.num_kv_heads * c.head_dim * 4  # float32 K and V
    pages = sum(len(p) // PAGE for p in prompts) + len(prompts[0]) // PAGE
    assert f"kvjax:router_kv_transfer_bytes_total {float(pages * page_bytes)}" in metrics
    assert "kvjax:router_kv_transfers_total 4.0" in metrics


def test_pd_chat_answers_as_colocated(servers, model):
    prefill, decode = servers
    body = dict(model="tiny", messages=[dict(role="user", content="tell me a long story")],
                max_tokens=MAX_NEW, temperature=0)

    async def scenario(client, router):
        return await client.post("/v1/chat/completions", json=body)

    answer = run_router([prefill.base_url], [decode.base_url], scenario)
    assert answer.status_code == 200, answer.text
    same = httpx.post(prefill.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert answer.json()["choices"] == same["choices"]
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= PAGE


def test_pages_of_another_provenance_are_refused_with_400(servers, model):
    prefill, decode = servers
    body = dict(model="tiny", prompt=_tokens(model, "a prompt of a few pages, tenant a"),
                max_tokens=2)
    frame = httpx.post(prefill.base_url + "/pd/prefill/completions", json=body,
                       headers={"x-tenant": "a"}, timeout=60)
    assert frame.status_code == 200, frame.text
    header, arrays = decode_frame(frame.content)
    assert header["num_pages"] == len(body["prompt"]) // PAGE and arrays
    refused = httpx.post(decode.base_url + "/pd/decode", content=frame.content,
                         headers={"x-tenant": "b"}, timeout=60)
    assert refused.status_code == 400
    assert "provenance mismatch" in refused.json()["error"]["message"]
    assert header["provenance"] in refused.json()["error"]["message"]
    version_2 = b"KVPD" + (2).to_bytes(4, "little") + (0).to_bytes(4, "little")
    garbage = httpx.post(decode.base_url + "/pd/decode", content=version_2, timeout=60)
    assert garbage.status_code == 400 and "version" in garbage.json()["error"]["message"]


def test_a_failed_prefill_replica_is_retried_elsewhere_else_503(servers, model):
    prefill, decode = servers
    body = dict(model="tiny", prompt=_tokens(model, "retry me on another prefill"),
                max_tokens=3, temperature=0)

    async def scenario(client, router):
        answer = await client.post("/v1/completions", json=body)
        return answer, router.metrics.retries._value.get()

    answer, retries = run_router([prefill.base_url], [decode.base_url], scenario,
                                 dead_first=True)
    assert answer.status_code == 200, answer.text
    assert retries == 1
    tokens = greedy_reference(model, body["prompt"], 3, stop=(EOS,))
    assert answer.json()["choices"][0]["text"] == model.tokenizer.decode(tokens)

    async def nobody(client, router):
        return await asyncio.wait_for(client.post("/v1/completions", json=body), 30)

    refused = run_router([], [decode.base_url], nobody, dead_first=True)
    assert refused.status_code == 503
