"""The server end to end, at length: the embedded SmolLM2 through scripts/serve.py (SIGTERM
included), 64 concurrent streaming clients, seeded sampling. `make test-slow` runs these.

Oracles: in-process `kvjax.generate` / `Engine.generate` on the same weights and engine config
(token for token), `greedy_reference` on the tiny model, Prometheus's parser for /metrics.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvjax
from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.bench import engine_config_from, load_config
from kvjax.server import BackgroundServer, ServerConfig
from kvjax.testing import greedy_reference, tiny_chat_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = EngineConfig(page_size=8, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64,
                           max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_values(base_url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def token_ids(logprobs_tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


@pytest.fixture(scope="module")
def served_script():
    """scripts/serve.py on the embedded model and configs/serve_demo.py, in a subprocess."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/serve.py"), f"--port={port}",
         "--config=configs/serve_demo.py", "--drain_timeout_s=120", "--log_level=warning"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(base_url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"serve.py did not come up: {process.stdout.read()[-2000:]}")
        time.sleep(0.5)
    yield process, base_url
    if process.poll() is None:
        process.kill()
        process.wait()


def test_embedded_model_over_http_equals_in_process_generate(served_script, embedded_model):
    _, base_url = served_script
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
    engine_config = engine_config_from(load_config(ROOT / "configs/serve_demo.py"))
    question = "What is the capital of France?"
    chat_ids = kvjax.encode_prompt(embedded_model, question, chat=True)
    text_ids = kvjax.encode_prompt(embedded_model, "The three primary colors are")
    expected = kvjax.generate(embedded_model, [chat_ids, text_ids],
                              SamplingParams(max_new_tokens=24), engine_config=engine_config)
    want_chat, want_text = (o.outputs[0] for o in expected)

    chat = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": question}], max_tokens=24,
        temperature=0, logprobs=True, extra_body=dict(return_tokens_as_token_ids=True))
    assert token_ids(t.token for t in chat.choices[0].logprobs.content) == want_chat.token_ids
    assert chat.choices[0].message.content == want_chat.text
    assert "Paris" in chat.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": question}], max_tokens=24,
        temperature=0, stream=True) if c.choices)
    assert streamed == want_chat.text

    completion = client.completions.create(
        model="smollm2-135m", prompt="The three primary colors are", max_tokens=24,
        temperature=0, logprobs=0, extra_body=dict(return_tokens_as_token_ids=True))
    assert token_ids(completion.choices[0].logprobs.tokens) == want_text.token_ids
    assert completion.choices[0].text == want_text.text
    chunks = list(client.completions.create(
        model="smollm2-135m", prompt="The three primary colors are", max_tokens=24,
        temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want_text.text


def test_sigterm_under_load_finishes_in_flight_refuses_new_and_exits_0(served_script):
    process, base_url = served_script
    results: dict[int, tuple[str, str | None]] = {}

    def stream(i):
        body = dict(prompt=[1, 504 + i, 2000 + i], max_tokens=16, temperature=0,
                    ignore_eos=True, stream=True)
        text, reason = "", None
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text, reason = text + choice["text"], choice["finish_reason"] or reason
        results[i] = (text, reason)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    time.sleep(2.0)  # all four are admitted (the demo config runs 8 at once)
    process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.TransportError):
        httpx.post(base_url + "/v1/completions", json=dict(prompt=[1, 2], max_tokens=1),
                   timeout=30)
    for w in workers:
        w.join(timeout=600)
    assert process.wait(timeout=600) == 0
    assert sorted(results) == [0, 1, 2, 3]
    assert all(reason == "length" and text for text, reason in results.values())


def test_64_concurrent_streaming_clients_complete_or_get_429():
    model = tiny_chat_model()
    engine = Engine(model, TINY_CONFIG)
    engine.warmup()
    prompts = [[(7 * i + j) % 120 + 3 for j in range(4 + i % 9)] for i in range(64)]
    max_tokens = [8 + i % 17 for i in range(64)]
    with BackgroundServer(engine, ServerConfig(model_name="tiny", max_waiting=16)) as server:
        before = metric_values(server.base_url)
        outcomes: dict[int, object] = {}

        def client(i):
            body = dict(prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
                        stream=True, stream_options=dict(include_usage=True))
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                              timeout=120) as r:
                if r.status_code != 200:
                    r.read()
                    outcomes[i] = (r.status_code, r.headers.get("Retry-After"))
                    return
                ids, text, usage, lines = set(), "", None, []
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        ids.add(chunk["id"])
                        text += "".join(c["text"] for c in chunk["choices"])
                        usage = chunk.get("usage") or usage
                outcomes[i] = (200, ids, text, usage, [x for x in lines if x][-1])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert time.monotonic() - start < 120 and len(outcomes) == 64
        time.sleep(0.2)
        after = metric_values(server.base_url)
    served = [i for i, o in outcomes.items() if o[0] == 200]
    refused = [i for i, o in outcomes.items() if o[0] != 200]
    assert all(outcomes[i] == (429, "1") for i in refused)
    assert served, "no request was served"
    response_ids = set()
    for i in served:
        _, ids, text, usage, last_line = outcomes[i]
        assert len(ids) == 1 and not ids & response_ids  # one response each, none shared
        response_ids |= ids
        tokens = greedy_reference(model, prompts[i], max_tokens[i], stop=(127,))
        assert text == model.tokenizer.decode(tokens)
        assert usage["completion_tokens"] == len(tokens) and last_line == "data: [DONE]"

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("kvjax:e2e_request_latency_seconds_count") == len(served)
    assert grew("kvjax:num_requests_rejected_total{reason=queue_full}") == len(refused)
    assert grew("kvjax:generation_tokens_total") == sum(outcomes[i][3]["completion_tokens"]
                                                        for i in served)
    assert after["kvjax:kv_cache_pages_used"] == 0 and after["kvjax:num_requests_running"] == 0
    assert after["kvjax:num_compiles"] == before["kvjax:num_compiles"]


def test_seeded_sampling_equals_the_in_process_engine_and_compiles_nothing_after_warmup():
    model = tiny_chat_model()
    prompt = [5, 6, 7, 8, 9]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                              n=3)
    (expected,) = Engine(model, TINY_CONFIG).generate([prompt], sampling)
    served = Engine(model, TINY_CONFIG)
    compiled = served.warmup(sampling=True)
    with BackgroundServer(served, ServerConfig(model_name="tiny")) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.9,
                      seed=3, n=3, logprobs=0, extra_body=dict(
                          top_k=20, return_tokens_as_token_ids=True))
        first = client.completions.create(**kwargs)
        again = client.completions.create(**kwargs)
        client.completions.create(model="tiny", prompt=[[1, 2, 3]] * 4, max_tokens=8)  # T=1
        assert metric_values(s.base_url)["kvjax:num_compiles"] == compiled
    for got in (first, again):
        assert [token_ids(c.logprobs.tokens) for c in got.choices] == [
            o.token_ids for o in expected.outputs]
        assert [c.text for c in got.choices] == [o.text for o in expected.outputs]
    assert len({tuple(o.token_ids) for o in expected.outputs}) > 1  # the samples do differ
