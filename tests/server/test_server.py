"""The HTTP server driven by real clients (the official `openai` client, httpx) on loopback.

One server on the tiny model (with `tiny_tokenizer`, so text, chat and streaming run) is
shared by the module. Oracles: `greedy_reference` and the dense forward pass (cache-free) for
tokens, text and logprobs; the tokenizer's own decode for text; Prometheus's text parser for
/metrics. Only greedy requests run here (sampled ones compile other step programs; they are
in test_server_slow.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import threading
import time

import httpx
import hypothesis
import hypothesis.strategies as st
import numpy as np
import openai
import pytest
from affinity_reference import unkeyed_digest
from prometheus_client.parser import text_string_to_metric_families
from strategies import HOSTILE_TEXT

import kvjax
from kvjax import Engine, EngineConfig
from kvjax.engine.runner import StepObserver
from kvjax.engine.snapshot import provenance_parts
from kvjax.memory.prefix_cache import hash_page, hash_root
from kvjax.server import BackgroundServer, ServerConfig
from kvjax.server.kv_state import affinity_key
from kvjax.server.metrics import VLLM_NAMES
from kvjax.server.protocol import ChatCompletionRequest, CompletionRequest
from kvjax.testing import dense_logprobs, greedy_reference, tiny_chat_model

MODEL_NAME = "tiny"
MAX_WAITING = 8
EOS = 127
# One prefill chunk size and at most 4 rows: 6 step shapes to compile.
CONFIG = EngineConfig(page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                      max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)


class _SlowSteps(StepObserver):
    """Makes every step take a little longer, so a request is still running when a test
    acts on it (disconnects, drains)."""

    def before_step(self, shape, host_input):
        time.sleep(0.01)


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(model, CONFIG)
    engine.warmup()
    config = ServerConfig(model_name=MODEL_NAME, max_waiting=MAX_WAITING, drain_timeout_s=10)
    with BackgroundServer(engine, config) as s:
        s.engine = engine
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def reference(model, prompt_ids, max_tokens):
    tokens = greedy_reference(model, prompt_ids, max_tokens, stop=(EOS,))
    return tokens, model.tokenizer.decode(tokens)


def reference_logprobs(model, prompt_ids, tokens):
    """log p(token_i | prompt, tokens_<i) and the rows they come from, from the dense pass."""
    rows = dense_logprobs(model, list(prompt_ids) + list(tokens))[len(prompt_ids) - 1:-1]
    return rows[np.arange(len(tokens)), tokens], rows  # [len(tokens)], [len(tokens), V]


def scrape(http) -> dict[str, float]:
    """/metrics as {sample name + sorted labels: value}, through Prometheus's own parser."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


PROMPTS = [[5, 9, 20, 33, 40], [70, 3, 3, 12], list(range(10, 40))]


def test_completions_equal_the_cache_free_reference(model, client):
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12,
                                    temperature=0, logprobs=0,
                                    extra_body=dict(return_tokens_as_token_ids=True))
    assert [c.index for c in got.choices] == [0, 1, 2]
    num_completion = 0
    for prompt, choice in zip(PROMPTS, got.choices, strict=True):
        tokens, text = reference(model, prompt, 12)
        assert choice.text == text
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in tokens]
        expected, _ = reference_logprobs(model, prompt, tokens)
        np.testing.assert_allclose(choice.logprobs.token_logprobs, expected, atol=2e-4)
        assert choice.finish_reason == ("stop" if tokens[-1] == EOS else "length")
        num_completion += len(tokens)
    assert got.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert got.usage.completion_tokens == num_completion


def test_text_prompt_and_chat_follow_the_tokenizer_and_template(model, client):
    tokenizer = model.tokenizer
    got = client.completions.create(model=MODEL_NAME, prompt="Hello, kvjax!", max_tokens=10,
                                    temperature=0)
    assert got.choices[0].text == reference(model, tokenizer.encode("Hello, kvjax!"), 10)[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                          temperature=0)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == reference(model, prompt, 10)[1]
    assert chat.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_chunks_concatenate_to_the_full_response(client, chat):
    kwargs = dict(model=MODEL_NAME, max_tokens=20, temperature=0, n=2, stop=["!", "xy"])
    if chat:
        create, kwargs["messages"] = client.chat.completions.create, [
            {"role": "user", "content": "Tell me."}]
    else:
        create, kwargs["prompt"] = client.completions.create, [1, 50, 60, 70]
    full = create(**kwargs)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    want = [c.message.content if chat else c.text for c in full.choices]
    assert texts == want and want[0] == want[1]  # n = 2 greedy samples agree
    assert reasons == [c.finish_reason for c in full.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_and_stop_token_ids_end_the_text(model, client):
    prompt = [5, 9, 20, 33, 40]
    tokens, text = reference(model, prompt, 24)
    stop = text[6:8]
    cut = text[:text.find(stop)]
    for stream in (False, True):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                        temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = list(got)
            assert "".join(c.choices[0].text for c in chunks) == cut
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                    temperature=0, extra_body=dict(stop_token_ids=[stop_id]))
    assert got.choices[0].text == model.tokenizer.decode(tokens[:first])
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == first + 1  # the stop token counts, its text is left out
    # vLLM's extensions: the stop string kept; special tokens spelled out in the text.
    for stream in (False, True):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                        temperature=0, stop=[stop], stream=stream,
                                        extra_body=dict(include_stop_str_in_output=True))
        kept = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert kept == cut + stop
    special = [t for t in tokens if model.tokenizer.decode([t]) == ""]
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                    temperature=0, extra_body=dict(skip_special_tokens=False))
    assert got.choices[0].text == model.tokenizer.decode(tokens, skip_special_tokens=False)
    assert bool(special) == (got.choices[0].text != text)


def test_top_logprobs_rank_the_models_distribution(model, client):
    messages = [{"role": "user", "content": "Hi"}]
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3)
    tokenizer = model.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    tokens, _ = reference(model, prompt, 6)
    expected, rows = reference_logprobs(model, prompt, tokens)
    content = got.choices[0].logprobs.content
    assert len(content) == len(tokens)
    for entry, token, logprob, row in zip(content, tokens, expected, rows, strict=True):
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(logprob, abs=2e-4)
        top3 = np.argsort(-row)[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row[top3], abs=2e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the top token


def test_bad_requests_get_400_naming_the_field_while_others_are_served(model, server, http):
    good_prompt = [7, 8, 9]
    result = {}

    def good():
        result["body"] = http.post("/v1/completions", json=dict(
            prompt=good_prompt, max_tokens=40, temperature=0)).json()

    worker = threading.Thread(target=good)
    worker.start()
    bad = [
        ("/v1/completions", dict(prompt=[1, 2], max_tokens="8"), "max_tokens"),
        ("/v1/completions", dict(prompt=[1, 2.5]), "prompt"),
        ("/v1/completions", dict(prompt=[1, True]), "prompt"),
        ("/v1/completions", dict(prompt=None), "prompt"),
        ("/v1/completions", dict(prompt=[[1, [2]]]), "prompt"),
        ("/v1/completions", dict(prompt=[1, 500]), "prompt"),
        ("/v1/completions", dict(prompt=list(range(1, 120)) * 3), "prompt"),
        ("/v1/completions", dict(prompt=[1, 2], max_tokens=300), "max_tokens"),
        ("/v1/completions", dict(prompt=[1, 2], temperature=-1), "temperature"),
        ("/v1/completions", dict(prompt=[1, 2], top_p=0), "top_p"),
        ("/v1/completions", dict(prompt=[1, 2], stop_token_ids=[128]), "stop_token_ids"),
        ("/v1/completions", dict(prompt=[1, 2], n=50, max_tokens=200), "n"),
        ("/v1/completions", dict(prompt=[1, 2], bogus=1), "bogus"),
        ("/v1/chat/completions", dict(messages=[]), "messages"),
        ("/v1/chat/completions", dict(), "messages"),
        ("/v1/chat/completions", dict(messages=[dict(role="robot", content="x")]), "messages"),
        ("/v1/chat/completions", dict(messages=[dict(role="user", content="x")],
                                      top_logprobs=2), None),
    ]
    for path, body, param in bad:
        r = http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, (body, error)
    r = http.post("/v1/completions", content=b'{"prompt": [1, 2], "temperature": Infinity}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = http.post("/v1/completions", content=b"{not json", headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=dict(model="gpt-9", prompt=[1]))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/completions", json=dict(prompt=[1]), headers={"X-Priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"
    worker.join()
    assert result["body"]["choices"][0]["text"] == reference(model, good_prompt, 40)[1]
    assert http.get("/health").status_code == 200


def test_beyond_the_waiting_bound_requests_get_429_with_retry_after(client, http):
    r = http.post("/v1/completions", json=dict(prompt=[[1, 2]] * (MAX_WAITING + 1),
                                               max_tokens=2))
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL_NAME, prompt=[[1, 2]] * (MAX_WAITING + 1),
                                  max_tokens=2)
    ok = client.completions.create(model=MODEL_NAME, prompt=[[1, 2]] * MAX_WAITING,
                                   max_tokens=2, temperature=0)
    assert len(ok.choices) == MAX_WAITING
    assert scrape(http)["kvjax:num_requests_rejected_total{reason=queue_full}"] >= 2


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "blocking"])
def test_a_client_that_disconnects_is_aborted_and_its_pages_freed(model, server, http, stream):
    slow = _SlowSteps()
    server.engine.add_step_observer(slow)
    aborts = scrape(http).get("kvjax:request_success_total{finished_reason=abort}", 0)
    body = dict(prompt=[3, 4, 5], max_tokens=240, temperature=0, ignore_eos=True,
                stream=stream)
    try:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                next(r.iter_lines())
                assert scrape(http)["kvjax:kv_cache_pages_used"] > 0
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=0.5)
        assert wait_for(lambda: scrape(http)["kvjax:kv_cache_pages_used"] == 0, 5.0)
    finally:
        server.engine.remove_step_observer(slow)
    m = scrape(http)
    assert m["kvjax:request_success_total{finished_reason=abort}"] == aborts + 1
    assert m["kvjax:num_requests_running"] == 0
    r = http.post("/v1/completions", json=dict(prompt=[3, 4, 5], max_tokens=6, temperature=0))
    assert r.json()["choices"][0]["text"] == reference(model, [3, 4, 5], 6)[1]


def test_metrics_parse_and_count_what_was_served_without_recompiling(client, http):
    before = scrape(http)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 120, 5 + 3 * i)]
               for i in range(6)]
    usage = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4 + i,
                                       temperature=0).usage for i, p in enumerate(prompts)]
    after = scrape(http)

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew("kvjax:e2e_request_latency_seconds_count") == len(prompts)
    assert grew("kvjax:time_to_first_token_seconds_count") == len(prompts)
    assert grew("kvjax:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert grew("kvjax:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert grew("kvjax:engine_steps_total") > 0
    assert after["kvjax:num_compiles"] == before["kvjax:num_compiles"]
    assert after["kvjax:kv_cache_pages_used"] == 0 and after["kvjax:num_requests_queued"] == 0
    assert after["kvjax:kv_cache_pages_free"] == after["kvjax:kv_cache_pages_total"] == 64
    for name in ("kvjax:num_requests_waiting", "kvjax:num_requests_swapped",
                 "kvjax:num_preemptions_total", "kvjax:kv_cache_usage_perc",
                 "kvjax:kv_bytes_moved_total{tier=host}", "kvjax:kv_bytes_moved_total{tier=disk}",
                 "kvjax:time_per_output_token_seconds_count"):
        assert name in after
    # Every series vLLM also exports is there under vLLM's name, with the same value.
    aliased = [(k, k.replace(ours, theirs)) for k in after for ours, names in VLLM_NAMES.items()
               for theirs in names if k.split("{")[0].startswith(ours)]
    assert {theirs.split("{")[0] for _, theirs in aliased} >= {
        "vllm:num_requests_running", "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"}
    for ours, theirs in aliased:
        assert after[theirs] == after[ours], theirs


def test_tokenize_and_detokenize_are_what_the_endpoints_run(model, server, client, http):
    """vLLM's /tokenize gives the ids the completion and chat endpoints count as the prompt
    (their usage says so); /detokenize inverts it."""
    r = http.post("/tokenize", json=dict(prompt="Hi there!", return_token_strs=True)).json()
    assert r["tokens"] == model.tokenizer.encode("Hi there!") and r["count"] == 9
    assert "".join(r["token_strs"]) == "Hi there!"
    assert r["max_model_len"] == server.engine.max_model_len
    done = client.completions.create(model=MODEL_NAME, prompt="Hi there!", max_tokens=1,
                                     temperature=0)
    assert done.usage.prompt_tokens == r["count"]
    messages = [dict(role="user", content="Hello")]
    r = http.post("/tokenize", json=dict(messages=messages)).json()
    done = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                          temperature=0)
    assert done.usage.prompt_tokens == r["count"]
    assert http.post("/detokenize", json=dict(tokens=r["tokens"])).json()["prompt"] == \
        model.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    for path, body, param in (("/tokenize", dict(prompt="x", messages=messages), None),
                              ("/tokenize", dict(prompt="\udc80"), "prompt"),
                              ("/detokenize", dict(tokens=[1, 999]), "tokens")):
        r = http.post(path, content=json.dumps(body), headers={
            "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_scores_the_prompt_as_an_evaluation_harness_reads_it(model, server, client, http):
    """An lm-eval-harness style loglikelihood request (context + continuation ids, echo,
    logprobs=1, max_tokens 0 or 1): each prompt token's logprob equals the dense forward
    pass, and its top logprob says whether the continuation is greedy."""
    context, continuation = [5, 9, 20, 33], [40, 41, 7]
    prompt = context + continuation
    rows = dense_logprobs(model, prompt)  # [S, V]: row i predicts token i + 1
    for max_tokens in (0, 1):
        choice = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
            temperature=0, extra_body=dict(return_tokens_as_token_ids=True)).choices[0]
        lp = choice.logprobs
        assert lp.tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(prompt)],
                                   rows[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
        for i in range(1, len(prompt)):
            (top,) = lp.top_logprobs[i].keys()
            assert top == f"token_id:{int(np.argmax(rows[i - 1]))}"
        assert len(lp.tokens) == len(prompt) + max_tokens
        assert choice.text.startswith(model.tokenizer.decode(prompt))
        assert choice.finish_reason == "length"
    # A text prompt is echoed as sent, then the generated text, offsets in the whole text.
    text_prompt = "Hi there"
    full = client.completions.create(model=MODEL_NAME, prompt=text_prompt, max_tokens=4,
                                     echo=True, logprobs=0, temperature=0).choices[0]
    plain = client.completions.create(model=MODEL_NAME, prompt=text_prompt, max_tokens=4,
                                      temperature=0).choices[0]
    assert full.text == text_prompt + plain.text
    offsets = full.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[len(text_prompt)] == len(text_prompt)  # one byte per token: the 1st output
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=text_prompt, max_tokens=4, echo=True, temperature=0,
        stream=True))
    assert streamed == full.text
    r = http.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_score_each_prompt_token_as_vllm_returns_them(model, server, client,
                                                                      http):
    """vLLM's `prompt_logprobs=k`: per prompt token (the first None) the token's logprob and
    rank and the top k there, equal to the dense forward pass; on each completions choice
    (n > 1 included), at the top of a chat response; refused with stream=true."""
    prompt = [5, 9, 20, 33, 40]
    rows = dense_logprobs(model, prompt)  # row i predicts token i + 1
    done = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, n=2,
                                     temperature=0, extra_body=dict(prompt_logprobs=2))
    for choice in done.choices:
        entries = choice.model_extra["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for i, entry in enumerate(entries[1:]):
            row, token = rows[i], prompt[i + 1]
            order = np.argsort(-row)
            want = {int(t) for t in order[:2]} | {token}
            assert {int(t) for t in entry} == want
            assert entry[str(token)]["rank"] == 1 + int(np.sum(row > row[token]))
            for t, e in entry.items():
                np.testing.assert_allclose(e["logprob"], row[int(t)], atol=2e-4)
                assert e["decoded_token"] == model.tokenizer.decode(
                    [int(t)], skip_special_tokens=False)
            assert [entry[str(int(t))]["rank"] for t in order[:2]] == [1, 2]
    chat = http.post("/v1/chat/completions", json=dict(
        model=MODEL_NAME, messages=[dict(role="user", content="Hi")], max_tokens=1,
        temperature=0, prompt_logprobs=0)).json()
    lps = chat["prompt_logprobs"]
    assert lps[0] is None and all(len(e) == 1 for e in lps[1:])  # k = 0: the token alone
    assert len(lps) == chat["usage"]["prompt_tokens"]
    r = http.post("/v1/completions", json=dict(prompt=prompt, max_tokens=1, stream=True,
                                               prompt_logprobs=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_logprobs_after_temperature_are_of_the_distribution_sampled_from(model):
    """With `logprobs_after_temperature`, a sampled request's token and top logprobs are
    log-softmax(logits / T) of the dense pass at each position (the default reports the
    model's own, T = 1)."""
    prompt, temperature = [5, 9, 20, 33], 0.5
    config = ServerConfig(model_name=MODEL_NAME, logprobs_after_temperature=True)
    with BackgroundServer(Engine(model, CONFIG), config) as s:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)
        got = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, seed=1,
                                   temperature=temperature, logprobs=2, extra_body=dict(
                                       return_tokens_as_token_ids=True)).choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in got.tokens]
    rows = dense_logprobs(model, prompt + tokens)[len(prompt) - 1:]  # row j predicts token j
    scaled = rows / temperature
    scaled -= np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) + \
        scaled.max(-1, keepdims=True)
    for j, token in enumerate(tokens):
        np.testing.assert_allclose(got.token_logprobs[j], scaled[j, token], atol=2e-4)
        top = {int(t.removeprefix("token_id:")): v for t, v in got.top_logprobs[j].items()}
        assert set(top) == {int(t) for t in np.argsort(-scaled[j])[:2]}
        for t, v in top.items():
            np.testing.assert_allclose(v, scaled[j, t], atol=2e-4)
    assert not np.allclose(scaled[0, tokens[0]], rows[0, tokens[0]], atol=1e-3)


def test_vllm_bench_client_body_is_served(model, server, http):
    """The body vLLM's own benchmark client (`vllm bench serve`, openai backend) sends for
    every request, field for field: served, with the usage chunk it reads."""
    prompt = [5, 9, 20, 33, 40]
    body = {"model": MODEL_NAME, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 6,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = greedy_reference(model, prompt, 6)  # ignore_eos: all 6 tokens
    assert text == model.tokenizer.decode(tokens)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_sampling_controls_reach_the_engine_and_bad_ones_get_400(model, server, client, http):
    """logit_bias steers greedy decoding (reported logprobs stay the model's own); values
    outside OpenAI's and vLLM's ranges are 400s naming the field."""
    prompt = [5, 9, 20, 33, 40]
    got = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
        logit_bias={"50": 100}, extra_body=dict(return_tokens_as_token_ids=True))
    assert got.choices[0].logprobs.tokens == ["token_id:50"] * 4
    expected, _ = reference_logprobs(model, prompt, [50] * 4)
    np.testing.assert_allclose(got.choices[0].logprobs.token_logprobs, expected, atol=2e-4)
    for extra, param in ((dict(presence_penalty=2.5), "presence_penalty"),
                         (dict(frequency_penalty=-3), "frequency_penalty"),
                         (dict(repetition_penalty=0), "repetition_penalty"),
                         (dict(logit_bias={"999": 1}), "logit_bias"),
                         (dict(logit_bias={"x": 1}), "logit_bias"),
                         (dict(logit_bias={"5": 101}), "logit_bias"),
                         (dict(min_p=1.5), "min_p"), (dict(min_tokens=9), "min_tokens")):
        r = http.post("/v1/completions", json=dict(prompt=prompt, max_tokens=4, **extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_api_keys_decide_the_tenant(model):
    """With API keys, a request without a valid key is a 401 before its body is read; the
    key decides the tenant, and a tenant the client names nests inside the key's, so one
    key never reads another's prefix cache."""
    config = ServerConfig(model_name=MODEL_NAME, api_keys={"key-a": "a", "key-b": "b"},
                          allow_client_tenant=True, affinity_secret="replica-secret")
    prompt = list(range(40, 72))  # 4 full pages of 8 tokens: 24 cached on a hit
    with BackgroundServer(Engine(model, CONFIG), config) as server:
        def cached(key, **kwargs):
            c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
            return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                        temperature=0, **kwargs).usage.prompt_tokens_details \
                .cached_tokens

        for key in ("wrong", "key-a "[:-2]):
            with pytest.raises(openai.AuthenticationError):
                cached(key)
        r = httpx.post(server.base_url + "/v1/completions", json=dict(prompt="bad body"),
                       headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert httpx.post(server.base_url + "/tokenize", json=dict(prompt="x")
                          ).status_code == 401
        assert cached("key-a") == 0 and cached("key-a") == 24
        assert cached("key-b") == 0  # another key: another tenant
        assert cached("key-b", user="a") == 0  # naming key a's tenant gives "b/a", not "a"
        assert cached("key-b", user="a") == 24
        # /kv_state names the keys' tenants by digests keyed with the configured secret: a
        # router holding it computes them; unkeyed hashes of the headers match none.
        roots = httpx.get(server.base_url + "/kv_state",
                          headers={"Authorization": "Bearer key-a"}).json()["prefix_roots"]
        assert set(roots) == {affinity_key(f"Bearer {key}", user, None, secret="replica-secret")
                              for key, user in (("key-a", None), ("key-b", None), ("key-b", "a"))}
        assert not set(roots) & {unkeyed_digest(f"Bearer {key}", user, None)
                                 for key in ("key-a", "key-b") for user in (None, "a")}
    config = dataclasses.replace(config, allow_client_tenant=None)  # keys: names ignored
    assert not config.honours_client_tenant
    with pytest.raises(ValueError, match="api_keys"):
        ServerConfig(model_name=MODEL_NAME, api_keys={"k\ud800": None})


def test_tenants_salt_the_prefix_cache(client, http):
    prompt = list(range(40, 72))  # 4 full pages of 8 tokens
    before = scrape(http)

    def cached(**kwargs):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                         temperature=0, **kwargs).usage.prompt_tokens_details \
            .cached_tokens

    assert cached(user="alice") == 0
    assert cached(user="alice") == 24  # the last page holds the prompt's last token: recomputed
    assert cached(user="bob") == 0
    assert cached(extra_headers={"X-Tenant": "alice"}) == 24
    assert cached(extra_headers={"X-Tenant": "bob"}, user="alice") == 24  # header wins: bob's
    after = scrape(http)
    assert after["kvjax:prefix_cache_hits_total"] - before["kvjax:prefix_cache_hits_total"] == 72
    assert 0 < after["kvjax:prefix_cache_hit_rate"] <= 1


def test_kv_state_reports_the_prompt_page_chain_a_router_computes(server, http):
    prompt = list(range(80, 105))  # 3 full pages and one token
    r = http.post("/v1/completions", json=dict(prompt=prompt, max_tokens=2, temperature=0),
                  headers={"X-Request-Id": "router-chosen-1"})
    assert r.status_code == 200 and r.json()["id"] == "router-chosen-1"
    state = http.get("/kv_state").json()
    root = hash_root(server.engine.provenance(None))
    assert state["prefix_root"] == root.hex() and state["page_size"] == CONFIG.page_size
    parent, chain = root, []
    for start in (0, 8, 16):  # the prefix cache's own hash, page by page
        parent = hash_page(parent, prompt[start:start + 8])
        chain.append(parent[:8].hex())
    assert set(chain) <= set(state["prefix_hashes"])
    assert state["num_pages"] == CONFIG.num_pages and 0 < state["num_free_pages"] <= 64
    assert (state["num_running"], state["num_waiting"], state["queued_prefill_tokens"]) == \
        (0, 0, 0)
    bad = http.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=1),
                    headers={"X-Request-Id": "x" * 1000})
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


def test_kv_state_reports_each_tenants_chain_root_by_affinity_key(server, http):
    prompt = list(range(90, 115))  # 3 full pages and one token
    asks = {  # affinity key -> what the engine keys that request's pages by
        affinity_key(None, "carol", None): server.engine.provenance("carol"),
        affinity_key(None, "carol", "team-salt"): server.engine.provenance(None)
        + b"|salt=team-salt",
    }
    for tenant, salt in (("carol", None), ("carol", "team-salt")):
        body = dict(prompt=prompt, max_tokens=2, temperature=0, user=tenant)
        if salt is not None:
            body["cache_salt"] = salt
        assert http.post("/v1/completions", json=body).status_code == 200
    state = http.get("/kv_state").json()
    for key, cache_key in asks.items():
        root = bytes.fromhex(state["prefix_roots"][key])
        assert root == hash_root(cache_key)
        parent, chain = root, []
        for start in (0, 8, 16):  # the prefix cache's own hash, page by page
            parent = hash_page(parent, prompt[start:start + 8])
            chain.append(parent[:8].hex())
        assert set(chain) <= set(state["prefix_hashes"])
    # No key names the pages of a tenant that sent nothing; the default root is its own.
    assert affinity_key(None, "dave", None) not in state["prefix_roots"]
    assert state["prefix_root"] not in {state["prefix_roots"][k] for k in asks}


def test_models_health_and_priority_header(server, client, http):
    (listed,) = client.models.list().data
    assert listed.id == MODEL_NAME
    card = http.get("/v1/models").json()["data"][0]  # what vLLM's clients read
    assert card["root"] and card["parent"] is None
    assert card["max_model_len"] == server.engine.max_model_len
    assert card["permission"][0]["object"] == "model_permission"
    assert http.get("/version").json()["version"]
    assert http.get("/health").json() == {}
    r = http.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=2, temperature=0),
                  headers={"X-Priority": "5"})
    assert r.status_code == 200
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_slo_headers_reach_the_engine_and_bad_ones_get_400(server, http, monkeypatch):
    from kvjax import SLO

    seen = []
    add_request = server.engine.add_request

    def spy(*args, **kwargs):
        seen.append(kwargs.get("slo"))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(server.engine, "add_request", spy)
    body = dict(prompt=[1, 2], max_tokens=2, temperature=0)
    r = http.post("/v1/completions", json=body,
                  headers={"X-SLO-TTFT-S": "2.5", "X-KL-Budget": "0.1"})
    assert r.status_code == 200 and seen == [SLO(ttft_s=2.5, kl_budget=0.1)]
    for header, value in (("X-SLO-TTFT-S", "-1"), ("X-KL-Budget", "lots")):
        r = http.post("/v1/completions", json=body, headers={header: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == header.lower()
    assert len(seen) == 1  # the bad ones never reached the engine


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True),
                    HOSTILE_TEXT, st.lists(st.integers(-2, 200), max_size=4),
                    st.lists(HOSTILE_TEXT, max_size=2),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_FIELDS = ["model", "max_tokens", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids",
           "stream", "user", "echo", "max_completion_tokens", "stream_options",
           "presence_penalty", "ignore_eos", "prompt", "messages", "cache_salt",
           "return_tokens_as_token_ids", "skip_special_tokens", "include_stop_str_in_output",
           "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "structured_outputs", "add_generation_prompt", "tools", "tool_choice",
           "parallel_tool_calls", "frequency_penalty", "repetition_penalty", "logit_bias",
           "min_p", "min_tokens", "prompt_logprobs"]
# Values that are either greedy or invalid: a valid sampled or top-logprob request would
# compile step programs of its own, which this fast test leaves to test_server_slow.py.
_GREEDY_OR_INVALID = {
    "temperature": st.one_of(st.just(0), st.just(0.0), st.floats(max_value=-1e-3),
                             st.text(max_size=3), st.booleans(), st.lists(st.integers())),
    "logprobs": st.one_of(st.none(), st.integers(max_value=-1), st.integers(min_value=21),
                          st.text(max_size=3)),
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21),
                              st.text(max_size=3)),
}
# The sampling rules at their neutral value or invalid: a valid rule would compile the rules
# variant of each step shape.
_INVALID_TEXT = st.text(max_size=3)
_NEUTRAL_OR_INVALID = {
    "frequency_penalty": st.one_of(st.just(0.0), st.floats(min_value=2.01), _INVALID_TEXT),
    "repetition_penalty": st.one_of(st.just(1.0), st.floats(max_value=0.0), _INVALID_TEXT),
    "min_p": st.one_of(st.just(0.0), st.floats(min_value=1.01), _INVALID_TEXT),
    "min_tokens": st.one_of(st.just(0), st.integers(max_value=-1), _INVALID_TEXT),
    "logit_bias": st.one_of(st.just({}), st.dictionaries(
        HOSTILE_TEXT, st.one_of(st.floats(min_value=100.1), _INVALID_TEXT), max_size=2)),
    "prompt_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21),
                                 _INVALID_TEXT),
}
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
     "content": st.one_of(st.text(alphabet="abc ", max_size=8), HOSTILE_TEXT, st.integers())}),
    max_size=2)
_MAIN_FIELD = {"prompt": st.lists(st.integers(0, 127), min_size=1, max_size=6),
               "messages": _MESSAGES}


def _bodies(main: str):
    """Bodies near the valid ones: `main` (prompt or messages) and max_tokens usually right,
    a few other fields drawn from anything JSON."""
    fixed = {"temperature": _GREEDY_OR_INVALID["temperature"],
             main: st.one_of(_MAIN_FIELD[main], _VALUES),
             "max_tokens": st.one_of(st.integers(1, 4), _VALUES)}
    optional = {"logprobs": _GREEDY_OR_INVALID["logprobs"]}
    if main == "messages":
        optional["top_logprobs"] = _GREEDY_OR_INVALID["top_logprobs"]
    others = st.lists(st.sampled_from(_FIELDS), unique=True, max_size=3).flatmap(
        lambda names: st.fixed_dictionaries({n: _NEUTRAL_OR_INVALID.get(n, _VALUES)
                                             for n in names}))
    return st.tuples(st.fixed_dictionaries(fixed, optional=optional), others).map(
        lambda parts: {**parts[1], **parts[0]})


@hypothesis.settings(max_examples=30, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data())
@pytest.mark.parametrize("path,main", [("/v1/completions", "prompt"),
                                       ("/v1/chat/completions", "messages")],
                         ids=["completions", "chat"])
def test_fuzzed_bodies_get_a_4xx_json_error_or_an_answer(model, server, path, main, data):
    """Any body, lone surrogates and control characters in every string field included: an
    answer or a 4xx naming the problem, never the engine's internals; after each, a normal
    request is served."""
    body = data.draw(_bodies(main))
    # What an HTTP header value can carry: tab and space inside, visible ASCII and Latin-1.
    tenant = data.draw(st.one_of(st.none(), st.from_regex(
        "[a-z0-9_.\xe9\xff-]([\t a-z\xe9]{0,2}[a-z\xe9])?", fullmatch=True)))
    headers = {"content-type": "application/json"}
    if tenant is not None:
        headers["x-tenant"] = tenant.encode("latin-1")
    r = httpx.post(server.base_url + path, content=json.dumps(body, allow_nan=True),
                   timeout=60, headers=headers)
    for secret in _internals(server.engine):
        assert secret not in r.text
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"]
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json=dict(
        prompt=[9, 9], max_tokens=2, temperature=0))
    assert r.json()["choices"][0]["text"] == reference(model, [9, 9], 2)[1]


def test_the_fuzz_draws_every_request_field():
    fields = {field.alias or name for request in (CompletionRequest, ChatCompletionRequest)
              for name, field in request.model_fields.items()}
    assert fields - set(_FIELDS) - set(_GREEDY_OR_INVALID) == set()


def _internals(engine) -> list[str]:
    """Strings no response may show: the KV provenance's parts and this machine's paths."""
    parts = provenance_parts(engine)
    secrets = [engine.provenance().hex(), parts["weights_version"], parts["tokenizer"],
               str(pathlib.Path(kvjax.__file__).parent), ".py\""]
    return [s for s in secrets if len(s) >= 4]  # (the tiny model's weights version is "0")


def test_a_request_that_breaks_the_engine_fails_alone(model, server, http, monkeypatch):
    """Hostile identities are 400s naming the field, and an internal error while adding one
    request is that request's 500 (without its text); the engine serves the next ones."""
    body = dict(prompt=[1, 2], max_tokens=2, temperature=0)
    for extra, headers, param in (
            (dict(user="\ud800"), {}, "user"), (dict(user="a\x00b"), {}, "user"),
            (dict(user="u" * 300), {}, "user"), ({}, {"X-Tenant": "a\tb"}, "X-Tenant"),
            (dict(prompt="caf\udce9"), {}, "prompt"), (dict(stop=["\ud800"]), {}, "stop")):
        # json.dumps escapes a lone surrogate as JSON allows ("\\ud800").
        r = http.post("/v1/completions", content=json.dumps({**body, **extra}),
                      headers={"content-type": "application/json", **headers})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/chat/completions", headers={"content-type": "application/json"},
                  content=json.dumps(dict(messages=[dict(role="user", content="hi \udfff")],
                                          max_tokens=2, temperature=0)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    secret = "weights=" + provenance_parts(server.engine)["weights_version"]
    add_request = server.engine.add_request

    def broken(request_id, *args, **kwargs):
        if kwargs.get("tenant") == "breaks":
            raise RuntimeError(f"key {secret} in /some/path.py")
        return add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(server.engine, "add_request", broken)
    r = http.post("/v1/completions", json={**body, "user": "breaks"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert secret not in r.text and "path" not in r.text
    monkeypatch.undo()
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == reference(model, [1, 2], 2)[1]
    assert server.app.state.async_engine.num_waiting == 0


def test_huge_prompts_and_n_are_refused_before_any_work(server, http):
    """A text prompt too long for the context whatever its tokens is refused without
    tokenizing it (the event loop stays free), and n beyond the waiting bound at once."""
    start = time.monotonic()
    r = http.post("/v1/completions", json=dict(prompt="x" * 5_000_000, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "characters" in r.json()["error"]["message"]
    assert time.monotonic() - start < 5.0
    r = http.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=2, n=MAX_WAITING + 1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_fuzzing_left_the_server_healthy(model, http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=dict(prompt=[9, 9], max_tokens=5, temperature=0))
    assert r.json()["choices"][0]["text"] == reference(model, [9, 9], 5)[1]


def test_draining_finishes_in_flight_requests_and_refuses_new_ones(model):
    engine = Engine(model, CONFIG)  # The module's server compiled its programs: cache hits.
    engine.add_step_observer(_SlowSteps())
    drained = BackgroundServer(engine, ServerConfig(model_name=MODEL_NAME, drain_timeout_s=20))
    drained.start()
    prompt, texts = [11, 12, 13], []

    def in_flight():
        body = dict(prompt=prompt, max_tokens=60, temperature=0, stream=True)
        with httpx.stream("POST", drained.base_url + "/v1/completions", json=body,
                          timeout=60) as r:
            texts.extend(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                         if line.startswith("data: {"))

    worker = threading.Thread(target=in_flight)
    worker.start()
    assert wait_for(lambda: drained.app.state.async_engine.num_live > 0)
    stopper = threading.Thread(target=drained.shutdown)  # what SIGTERM does
    stopper.start()
    assert wait_for(lambda: not drained.app.state.async_engine.is_admitting)
    try:
        refused = httpx.post(drained.base_url + "/v1/completions",
                             json=dict(prompt=[1], max_tokens=1), timeout=10).status_code
    except httpx.TransportError:  # refused, or closed by the shutdown before answering
        refused = "connection refused or closed"
    assert refused in (503, "connection refused or closed")
    worker.join()
    stopper.join()
    assert "".join(texts) == reference(model, prompt, 60)[1]
    assert not drained.is_running and not drained.app.state.async_engine.is_alive


def test_serve_bench_replays_a_workload_over_http(server, http):
    from kvjax.bench import BenchRequest, load_config
    from kvjax.bench.remote import run_http_benchmark_detailed

    requests = [BenchRequest(request_id=f"r{i}", arrival_time=0.05 * i,
                             prompt_ids=tuple(range(20 + i, 44 + i)), max_new_tokens=5 + i,
                             tenant=f"t{i % 2}") for i in range(4)]
    result = run_http_benchmark_detailed(load_config("configs/serve_demo.py"), server.base_url,
                                         requests=requests)
    m = result.metrics
    assert m["num_requests"] == 4 and m["failed_requests"] == 0
    assert sorted(r.num_output_tokens for r in result.records) == [5, 6, 7, 8]
    assert all(r.first_token_time >= r.arrival_time for r in result.records)
    assert m["ttft_p50_s"] > 0 and m["throughput_tok_s"] > 0
    assert m["compiles_after_warmup"] == 0 and m["preemptions"] == 0
    assert m["prefix_hit_rate"] is not None and m["bytes_moved"]["device"] is None
    assert m["fairness"]["per_tenant"]["t0"]["num_requests"] == 2
