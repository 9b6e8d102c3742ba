"""The engine under kvzip: query-agnostic scores from probe rows that repeat the context.

The oracle: for each probe, the cache-free dense forward pass over the prompt followed by the
probe's tokens records every layer's queries and keys, and tests/presses_reference.py scores
the probe's span of the prompt's keys in numpy (the most attention any probe query of a kv
head's group pays a key, summed over layers and kv heads; the softmax over the sinks, the span
and the probe, KVzip's, or over every key). After the probes, the engine caches exactly the
reference's kept tokens and holds exactly the pages of what it caches, whether the
step's token budget gives a probe 8 context tokens or 3 (a probe is one row), synchronous
scheduling or asynchronous.
"""

from __future__ import annotations

import numpy as np
import presses_reference as ref
import pytest
from test_engine_presses import BASE, BUDGET, MAX_NEW, PROMPT, dense_qkv, prompt_of, serve

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.kv.retention import make_retention
from kvjax.testing import tiny_model

P = BASE["page_size"]
OPTIONS = dict(chunk=8, num_sinks=2, tail=2, instruction_ids=(5, 6, 7), continue_ids=(8, 9),
               suffix_ids=(10,))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def reference_keep(model, prompt, room: int, softmax: str) -> list[int]:
    """The kept tokens, each probe at most `room` tokens (a probe row: the step's budget)."""
    policy = make_retention("kvzip", BUDGET, P, **OPTIONS, softmax=softmax)
    probes = policy.probes(prompt, room)
    chunk = min(OPTIONS["chunk"], room - 5)  # 5: the suffix and the longer instruction
    assert [(p.start, p.end) for p in probes] == [
        (a, min(a + chunk, PROMPT)) for a in range(0, PROMPT, chunk)]
    scores = np.zeros(len(prompt))
    for probe in probes:
        q, k, _ = dense_qkv(model, list(prompt) + list(probe.token_ids))
        span = slice(probe.start, probe.end)
        softmax_span = (probe.start, probe.end) if softmax == "chunk" else None
        scores[span] = sum(ref.probe_attention(q[i], k[i], len(prompt), softmax_span,
                                               OPTIONS["num_sinks"])[span]
                           for i in range(len(q)))
    return ref.keep(scores, BUDGET, first=OPTIONS["num_sinks"])


@pytest.mark.parametrize("budget_tokens,async_scheduling,softmax", [
    (32, False, "chunk"), (8, True, "chunk"), (32, False, "all")])
def test_kvzip_keeps_the_reference_tokens_after_its_probes(model, budget_tokens,
                                                           async_scheduling, softmax):
    config = dict(BASE, max_num_batched_tokens=budget_tokens, max_prefill_chunk=budget_tokens,
                  min_chunk_bucket=min(budget_tokens, BASE["min_chunk_bucket"]))
    engine = Engine(model, EngineConfig(**config, retention="kvzip", retention_budget=BUDGET,
                                        retention_options=dict(OPTIONS, softmax=softmax),
                                        async_scheduling=async_scheduling))
    engine.warmup()
    prompt = prompt_of(0)
    tokens, steps = serve(engine, "a", prompt)
    assert len(tokens) == MAX_NEW
    # The prompt's prefill (in chunks of the step budget), its probes, then the compaction.
    whole = next(i for i, (cached, _) in enumerate(steps) if len(cached) >= PROMPT)
    first = next(i for i, (cached, _) in enumerate(steps) if i > whole and len(cached) < PROMPT)
    kept = steps[first][0]
    assert kept == reference_keep(model, prompt, budget_tokens, softmax)
    assert engine.retention.stats["freed_pages"] >= -(-PROMPT // P) - -(-BUDGET // P)
    # Generated tokens are all kept after the compaction, on the budget's pages and theirs.
    for cached, used in steps[first:-1]:
        assert cached[:BUDGET] == kept
        assert used == -(-len(cached) // P)
    assert engine.stats["probe_rows"] == -(-PROMPT // min(OPTIONS["chunk"], budget_tokens - 5))
    compiles = engine.num_compiles
    serve(engine, "b", prompt_of(1))
    assert engine.num_compiles == compiles, "a request of the same shape compiled"


def test_kvzip_needs_probe_ids_or_a_tokenizer(model):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Engine(model, EngineConfig(**BASE, retention="kvzip", retention_budget=BUDGET))


def test_a_prompt_with_no_room_for_a_probe_is_refused_alone(model):
    engine = Engine(model, EngineConfig(**BASE, retention="kvzip", retention_budget=BUDGET,
                                        retention_options=OPTIONS))
    with pytest.raises(ValueError, match="request 'long'.*no room"):
        engine.add_request("long", prompt_of(2) * 2 + prompt_of(3)[:16],
                           SamplingParams(max_new_tokens=1))
    tokens, _ = serve(engine, "a", prompt_of(0))
    assert len(tokens) == MAX_NEW
