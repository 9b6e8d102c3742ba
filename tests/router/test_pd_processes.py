"""Prefill/decode disaggregation through processes: scripts/serve.py twice (a prefill and a
decode replica, the tiny chat model saved as a checkpoint) and scripts/router.py with
--prefill_replica, on 127.0.0.1. Replicas take tens of seconds to start, so this runs in
`make test-slow`; tests/router/test_pd_http.py covers the same semantics in-process.

Oracles: the dense greedy reference, the prefill replica's own colocated answer, page
arithmetic for the decode replica's prefix hits, and the router's /metrics for bytes moved.
"""

from __future__ import annotations

import time

import openai

from kvjax.bench.router_http import metric_sum, replica_processes, router_process
from kvjax.router.http import REPLICA_HEADER
from kvjax.testing import greedy_reference, tiny_chat_model

EOS = 127


def test_pd_across_processes_gives_the_colocated_greedy_tokens(replica_args, replica_page_size):
    page = replica_page_size
    model = tiny_chat_model()
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)]
               for i, n in enumerate((30, 17, 6, 41))]
    with replica_processes(replica_args, 2) as started:
        (prefill, _), (decode, _) = started
        with router_process([decode], "round_robin",
                            args=[f"--prefill_replica={prefill}"]) as router:
            client = openai.OpenAI(base_url=router + "/v1", api_key="-", max_retries=0,
                                   timeout=120)
            colocated = openai.OpenAI(base_url=prefill + "/v1", api_key="-", max_retries=0,
                                      timeout=120)
            name = client.models.list().data[0].id
            for prompt in prompts:
                raw = client.completions.with_raw_response.create(
                    model=name, prompt=prompt, max_tokens=8, temperature=0)
                answer = raw.parse()
                assert raw.headers[REPLICA_HEADER] == decode
                same = colocated.completions.create(model=name, prompt=prompt, max_tokens=8,
                                                    temperature=0)
                tokens = greedy_reference(model, prompt, 8, stop=(EOS,))
                assert answer.choices[0].text == model.tokenizer.decode(tokens)
                assert answer.choices[0].text == same.choices[0].text
                assert answer.usage.prompt_tokens_details.cached_tokens == \
                    (len(prompt) - 1) // page * page
            chat = dict(model=name, messages=[dict(role="user", content="hello, processes")],
                        max_tokens=8, temperature=0)
            whole = client.chat.completions.create(**chat).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(**chat, stream=True) if c.choices)
            assert streamed == whole == colocated.chat.completions.create(
                **chat).choices[0].message.content
            c = model.config
            page_bytes = 2 * c.num_layers * page * c.num_kv_heads * c.head_dim * 4
            moved = metric_sum(router, "kvjax:router_kv_transfer_bytes_total")
            assert moved >= sum(len(p) // page for p in prompts) * page_bytes
            assert metric_sum(router, "kvjax:router_kv_transfers_total") == len(prompts) + 2


def test_alternating_phases_across_processes_give_the_colocated_greedy_tokens(replica_args):
    """Two replicas take new requests in turn (router --phase_period_s): each request lands on
    the replica whose window it arrived in (the router's clock is CLOCK_MONOTONIC, the same in
    every process here), answers the dense greedy reference, and no KV moves."""
    model = tiny_chat_model()
    period = 4.0
    prompts = [[(5 * i + 2 * j) % 120 + 3 for j in range(n)]
               for i, n in enumerate((30, 17, 6, 41))]
    with replica_processes(replica_args, 2) as started:
        urls = [url for url, _ in started]
        with router_process(urls, "round_robin", args=[f"--phase_period_s={period}"]) as router:
            client = openai.OpenAI(base_url=router + "/v1", api_key="-", max_retries=0,
                                   timeout=120)
            name = client.models.list().data[0].id
            for i, prompt in enumerate(prompts):
                window = i % 2
                # Wait for the start of that replica's window (period/2 seconds each).
                wait = (window * period / 2 - time.monotonic()) % period
                time.sleep(wait + 0.1)
                raw = client.completions.with_raw_response.create(
                    model=name, prompt=prompt, max_tokens=8, temperature=0)
                assert raw.headers[REPLICA_HEADER] == urls[window]
                tokens = greedy_reference(model, prompt, 8, stop=(EOS,))
                assert raw.parse().choices[0].text == model.tokenizer.decode(tokens)
            assert metric_sum(router, "kvjax:router_kv_transfer_bytes_total") == 0
