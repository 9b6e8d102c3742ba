"""Tests of the benchmark corpus and workload generators."""

import collections
import json
import math
import pathlib
import re

import numpy as np
import pytest

from kvjax.bench import corpus, workloads
from kvjax.bench.workloads import BenchRequest, make_workload

_BOS = 1


class ByteTokenizer:
    """One id per UTF-8 byte (offset by 3), BOS = 1: decodable, so tests can read prompts."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([_BOS] if add_bos else []) + [b + 3 for b in text.encode("utf-8")]


def decode(ids) -> str:
    return bytes(i - 3 for i in ids if i != _BOS).decode("utf-8")


TOKENIZER = ByteTokenizer()

# Small parameters per workload, so each builds in milliseconds.
SMALL = {
    "poisson": dict(rate=5.0, prompt_max=300, output_max=64),
    "shared_prefix": dict(prefix_len=64, question_max=32),
    "multi_turn": dict(num_turns=3, user_max=40, answer_len=16, max_prompt_len=400),
    "long_context": dict(context_len=512, needle=True),
    "multi_tenant_burst": dict(prompt_len=64, output_len=32),
    "rl_group": dict(group_size=4, prompt_max=128),
    "rag": dict(num_docs=6, docs_per_prompt=3, doc_min_words=20, doc_max_words=40),
    "tenant_flood": dict(system_prompt_len=48, flood_share=0.5, burst_size=3,
                         flood_prompt_len=64),
}


def _build(name, seed, num_requests=12, **overrides):
    return make_workload(name, TOKENIZER, seed=seed, num_requests=num_requests,
                         **{**SMALL[name], **overrides})


# Corpus.


def test_corpus_is_deterministic_and_depends_on_seed():
    assert corpus.make_corpus(3, 10) == corpus.make_corpus(3, 10)
    assert corpus.make_corpus(3, 10) != corpus.make_corpus(4, 10)


def test_corpus_document_lengths_and_topics():
    docs = corpus.make_corpus(0, 60, min_words=40, max_words=200)
    assert all(40 <= len(d.split()) <= 200 for d in docs)
    text = " ".join(docs)
    markers = {"science": "degrees Celsius", "code comments": "# ", "dialogue": 'asked, "',
               "cooking": "minutes.", "history": "In the year", "travel": "take the",
               "facts": "was born in"}
    missing = [topic for topic, marker in markers.items() if marker not in text]
    assert not missing
    assert len(set(docs)) == len(docs)


@pytest.mark.parametrize("num_words", [0, 1, 2, 7, 50, 333])
def test_make_text_has_exactly_the_requested_words(num_words):
    text = corpus.make_text(np.random.default_rng(num_words), num_words)
    assert len(text.split()) == num_words
    assert text == "" or text[0].isupper() or text[0] == "#"


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_requested_depth_and_question_comes_last(fraction):
    prompt, answer = corpus.make_needle_prompt(np.random.default_rng(1), 500, "Ada Rossi", 4817,
                                               fraction)
    assert answer == "4817"
    needle = "The secret code of Ada Rossi is 4817."
    assert prompt.count(needle) == 1
    filler, question = prompt.split("\n\n")
    assert question.endswith("The secret code of Ada Rossi is")
    assert "Ada Rossi" in question
    before = len(filler[:filler.index(needle)].split())
    filler_words = len(filler.split()) - len(needle.split())
    # The needle goes at the nearest sentence boundary; sentences here are under 30 words.
    assert abs(before - fraction * filler_words) <= 30


def test_needle_validates_position():
    with pytest.raises(ValueError, match="position_fraction"):
        corpus.make_needle_prompt(np.random.default_rng(0), 10, "x", 1, 1.5)


# Every workload.


@pytest.mark.parametrize("name", sorted(SMALL))
def test_workload_is_deterministic_per_seed_and_differs_across_seeds(name):
    first, again, other = _build(name, 0), _build(name, 0), _build(name, 1)
    assert first == again
    assert [r.prompt_ids for r in first] != [r.prompt_ids for r in other]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_workload_is_sorted_with_unique_ids_and_bos_first(name):
    requests = _build(name, 2)
    assert len(requests) == 12
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    assert len({r.request_id for r in requests}) == len(requests)
    assert all(r.prompt_ids[0] == _BOS and _BOS not in r.prompt_ids[1:] for r in requests)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_prompts_are_english_corpus_text(name):
    words = " ".join(decode(r.prompt_ids) for r in _build(name, 5)).split()
    common = {"the", "of", "and", "to", "in", "a"}
    assert sum(w in common for w in words) > 0.05 * len(words)
    assert all(re.fullmatch(r"[\x20-\x7e\n]*", decode(r.prompt_ids)) for r in _build(name, 5))


def test_make_workload_rejects_unknown_name_and_parameters():
    with pytest.raises(ValueError, match="unknown workload 'poison'"):
        make_workload("poison", TOKENIZER, seed=0, num_requests=1)
    with pytest.raises(ValueError, match="rte"):
        make_workload("poisson", TOKENIZER, seed=0, num_requests=1, rte=2.0)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("poisson", TOKENIZER, seed=0)
    with pytest.raises(ValueError, match="path"):
        make_workload("trace", TOKENIZER, seed=0)
    with pytest.raises(ValueError, match="rate"):
        make_workload("poisson", TOKENIZER, seed=0, num_requests=1, rate=0.0)
    with pytest.raises(ValueError, match="prompt_dist"):
        make_workload("poisson", TOKENIZER, seed=0, num_requests=1, prompt_dist="zipf")


def test_bench_request_validates_fields():
    with pytest.raises(ValueError, match="prompt_ids"):
        BenchRequest("r", 0.0, (), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        BenchRequest("r", 0.0, (1,), 0)
    with pytest.raises(ValueError, match="arrival_time"):
        BenchRequest("r", -1.0, (1,), 4)


# Poisson arrivals and length distributions.


def test_poisson_arrival_rate_and_exponential_gaps():
    rate, num = 20.0, 2000
    requests = make_workload("poisson", TOKENIZER, seed=11, num_requests=num, rate=rate,
                             prompt_dist="fixed", prompt_len=8, output_dist="fixed",
                             output_len=4)
    gaps = np.diff([0.0] + [r.arrival_time for r in requests])
    # The mean gap of n exponential gaps has standard error (1/rate)/sqrt(n).
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(num)
    # An exponential's coefficient of variation is 1 (a uniform grid would give 0).
    assert 0.9 < gaps.std() / gaps.mean() < 1.1
    # Counts per 1-second window are Poisson: variance close to the mean.
    counts = np.bincount(np.floor([r.arrival_time for r in requests]).astype(int))[:-1]
    assert abs(counts.mean() - rate) < 2.0
    assert 0.6 < counts.var() / counts.mean() < 1.5


def test_infinite_rate_puts_everything_at_zero():
    requests = make_workload("poisson", TOKENIZER, seed=0, num_requests=5, rate=math.inf,
                             prompt_dist="fixed", prompt_len=8)
    assert [r.arrival_time for r in requests] == [0.0] * 5


def test_fixed_and_uniform_lengths():
    fixed = make_workload("poisson", TOKENIZER, seed=0, num_requests=20, prompt_dist="fixed",
                          prompt_len=37, output_dist="fixed", output_len=9)
    assert {len(r.prompt_ids) for r in fixed} == {37}
    assert {r.max_new_tokens for r in fixed} == {9}
    uniform = make_workload("poisson", TOKENIZER, seed=0, num_requests=400,
                            prompt_dist="uniform", prompt_min=10, prompt_max=20,
                            output_dist="uniform", output_min=3, output_max=5)
    assert {len(r.prompt_ids) for r in uniform} == set(range(10, 21))
    assert {r.max_new_tokens for r in uniform} == {3, 4, 5}


def test_lognormal_lengths_have_the_stated_median_spread_and_clipping():
    requests = make_workload("poisson", TOKENIZER, seed=3, num_requests=2000,
                             prompt_len=64, prompt_sigma=1.0, prompt_min=8, prompt_max=512,
                             output_len=50, output_sigma=0.5, output_min=4, output_max=1000)
    prompt_lens = np.array([len(r.prompt_ids) for r in requests])
    output_lens = np.array([r.max_new_tokens for r in requests])
    assert 8 <= prompt_lens.min() and prompt_lens.max() <= 512
    # Clipping piles mass on the bounds: P(X < 8) = Phi(-ln 8) ~ 1.9%, P(X > 512) ~ 1.9%.
    assert 0.005 < np.mean(prompt_lens == 8) < 0.04
    assert 0.005 < np.mean(prompt_lens == 512) < 0.04
    # Standard error of a sample median of log X is ~1.25 * sigma / sqrt(n) ~ 0.028 here.
    assert abs(np.log(np.median(prompt_lens)) - np.log(64)) < 0.12
    assert abs(np.log(np.median(output_lens)) - np.log(50)) < 0.06
    log_iqr = np.subtract(*np.percentile(np.log(output_lens), [75, 25]))
    assert abs(log_iqr - 2 * 0.6745 * 0.5) < 0.08  # normal IQR = 1.349 sigma


def test_default_poisson_lengths_are_chat_like():
    requests = make_workload("poisson", TOKENIZER, seed=0, num_requests=300)
    prompt_median = np.median([len(r.prompt_ids) for r in requests])
    output_median = np.median([r.max_new_tokens for r in requests])
    assert 150 < prompt_median < 400
    assert 120 < output_median < 300


# Structured workloads.


def test_shared_prefix_shares_exactly_the_requested_fraction():
    prefix_len = 64
    requests = _build("shared_prefix", 0, num_requests=40, shared_fraction=0.75,
                      prefix_len=prefix_len, question_min=16, question_max=20)
    prefixes = collections.Counter(r.prompt_ids[:prefix_len] for r in requests)
    counts = sorted(prefixes.values(), reverse=True)
    assert counts[0] == 30  # round(0.75 * 40) share one block
    assert counts[1:] == [1] * 10  # the others each have their own
    assert all(prefix_len + 16 <= len(r.prompt_ids) <= prefix_len + 20 for r in requests)
    questions = [r.prompt_ids[prefix_len:] for r in requests]
    assert len(set(questions)) == len(questions)


def test_shared_prefix_with_several_prefixes():
    requests = _build("shared_prefix", 1, num_requests=60, shared_fraction=1.0,
                      num_prefixes=3, prefix_len=32)
    assert len({r.prompt_ids[:32] for r in requests}) == 3


def test_multi_turn_prompts_extend_the_previous_turn():
    answer_len, user_min, user_max, max_prompt_len = 16, 10, 40, 200
    requests = _build("multi_turn", 4, num_requests=30, num_turns=5, answer_len=answer_len,
                      user_min=user_min, user_max=user_max, max_prompt_len=max_prompt_len)
    assert len(requests) == 30
    conversations = collections.defaultdict(list)
    for r in requests:
        conversations[r.conversation_id].append(r)
    assert len(conversations) > 1
    for turns in conversations.values():
        assert [t.turn for t in turns] == list(range(len(turns)))  # arrival order is turn order
        assert all(t.max_new_tokens == answer_len for t in turns)
        assert all(len(t.prompt_ids) <= max_prompt_len for t in turns)
        assert user_min + 1 <= len(turns[0].prompt_ids) <= user_max + 1  # + BOS
        for previous, current in zip(turns, turns[1:], strict=False):
            assert current.prompt_ids[:len(previous.prompt_ids)] == previous.prompt_ids
            added = len(current.prompt_ids) - len(previous.prompt_ids)
            assert answer_len + user_min <= added <= answer_len + user_max
            assert current.arrival_time >= previous.arrival_time


def test_long_context_lengths_stay_in_the_window():
    requests = _build("long_context", 0, num_requests=10, context_len=1000, spread=0.1,
                      needle=False)
    assert all(900 <= len(r.prompt_ids) <= 1000 for r in requests)
    assert all(r.answer is None for r in requests)


def test_long_context_needles_are_retrievable_and_spread_in_depth():
    requests = _build("long_context", 0, num_requests=5, context_len=1500, needle=True)
    depths = []
    for r in requests:
        assert len(r.prompt_ids) <= 1500
        assert len(r.prompt_ids) > 1500 * 0.95 - 200  # short by at most about one sentence
        text = decode(r.prompt_ids)
        match = re.search(r"The secret code of (.+?) is (\d{4})\.", text)
        assert match and match.group(2) == r.answer
        assert text.endswith(f"Answer: The secret code of {match.group(1)} is")
        depths.append(match.start() / len(text))
    assert depths == sorted(depths)
    assert depths[0] < 0.05 and depths[-1] > 0.85


def test_burst_tenant_gets_its_share_of_arrivals():
    num_tenants, multiplier, num = 4, 10.0, 1300
    requests = _build("multi_tenant_burst", 0, num_requests=num, num_tenants=num_tenants,
                      burst_multiplier=multiplier, base_rate=2.0)
    share = np.mean([r.tenant == "tenant-0" for r in requests])
    expected = multiplier / (multiplier + num_tenants - 1)  # 10 / 13
    assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / num)
    total_rate = num / requests[-1].arrival_time
    assert abs(total_rate - 2.0 * (multiplier + num_tenants - 1)) < 2.0


def test_tenant_flood_victim_requests_are_the_same_with_and_without_the_flood():
    flooded = _build("tenant_flood", 3, num_requests=18, flood_share=1 / 3)
    alone = _build("tenant_flood", 3, flood_share=0.0)
    victims = [r for r in flooded if r.tenant == "victim"]
    assert victims == alone and len(victims) == 12
    system = victims[0].prompt_ids[:48]
    assert all(r.prompt_ids[:48] == system and len(r.prompt_ids) == 64 for r in victims)
    flood = [r for r in flooded if r.tenant == "flooder"]
    assert [r.arrival_time for r in flood] == [0.0] * 3 + [4.0] * 3
    # No two flood prompts share even their first page of 16 tokens after BOS.
    assert len({r.prompt_ids[1:17] for r in flood}) == 6
    assert all(len(r.prompt_ids) == 64 for r in flood)


def test_burst_window_raises_only_that_tenants_rate_inside_it():
    requests = _build("multi_tenant_burst", 1, num_requests=400, num_tenants=3, base_rate=1.0,
                      burst_multiplier=8.0, burst_start_s=20.0, burst_duration_s=20.0)
    end = requests[-1].arrival_time
    assert end > 60

    def rate(tenant, start, stop):
        return sum(tenant == r.tenant and start <= r.arrival_time < stop
                   for r in requests) / (stop - start)

    # Inside: Poisson mean 160 arrivals; outside each tenant runs at 1 per second.
    assert 5.5 < rate("tenant-0", 20, 40) < 10.5
    assert 0.5 < rate("tenant-0", 40, end) < 1.6
    assert 0.5 < rate("tenant-1", 20, 40) < 1.6


def test_burst_system_prompts_are_shared_within_a_tenant_only():
    plain = _build("multi_tenant_burst", 2, num_requests=30, num_tenants=3, prompt_len=40)
    requests = _build("multi_tenant_burst", 2, num_requests=30, num_tenants=3, prompt_len=40,
                      system_prompt_len=24)
    systems = {}
    for r, p in zip(requests, plain, strict=True):
        assert (r.arrival_time, r.tenant, r.max_new_tokens) == (
            p.arrival_time, p.tenant, p.max_new_tokens)
        assert len(r.prompt_ids) == 24 + len(p.prompt_ids)
        systems.setdefault(r.tenant, set()).add(r.prompt_ids[:24])
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3


def test_rl_group_waves_and_group_size():
    requests = _build("rl_group", 0, num_requests=12, group_size=6, num_waves=3,
                      wave_interval_s=2.5)
    assert {r.n for r in requests} == {6}
    waves = collections.Counter(r.arrival_time for r in requests)
    assert waves == {0.0: 4, 2.5: 4, 5.0: 4}


# Traces.

EXAMPLE_TRACE = pathlib.Path(__file__).parents[2] / "data/traces/example_trace.jsonl"


def test_rag_documents_recur_with_the_same_ids_at_varying_positions():
    requests = _build("rag", seed=3, num_requests=20)
    seen: dict[tuple[int, ...], set[int]] = {}
    for r in requests:
        assert len(r.reuse_spans) == 3
        docs = [r.prompt_ids[a:b] for a, b in r.reuse_spans]
        assert len(set(docs)) == 3  # no document twice in one prompt
        assert all(decode(d).startswith("Document ") for d in docs)
        key = decode(r.prompt_ids[r.reuse_spans[-1][1]:]).split("code of ")[1].split("?")[0]
        holder = [d for d in docs if f"secret code of {key} is {r.answer}." in decode(d)]
        assert len(holder) == 1  # the answer is planted in exactly one retrieved document
        assert [seg.ids for seg in r.segments() if seg.reuse] == docs
        for d, (a, _) in zip(docs, r.reuse_spans, strict=True):
            seen.setdefault(d, set()).add(a)
    assert len(seen) <= 6 and max(len(starts) for starts in seen.values()) > 1


def test_example_trace_replays():
    with open(EXAMPLE_TRACE) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    requests = make_workload("trace", TOKENIZER, path=EXAMPLE_TRACE, seed=0)
    assert len(requests) == len(lines) == 22
    by_time = sorted(lines, key=lambda e: e["arrival_time"])
    for entry, r in zip(by_time, requests, strict=True):
        assert r.arrival_time == entry["arrival_time"]
        assert r.max_new_tokens == entry["output_len"]
        assert r.tenant == entry["tenant"]
        assert r.n == entry.get("n", 1) and r.priority == entry.get("priority", 0)
        if "prompt_ids" in entry:
            assert r.prompt_ids == tuple(entry["prompt_ids"])
        else:
            assert len(r.prompt_ids) == entry["prompt_len"]
    assert requests[-1].request_id == "chat-7-turn-1" and requests[-1].turn == 1


def test_trace_time_scale_and_num_requests():
    full = workloads.trace(TOKENIZER, path=EXAMPLE_TRACE)
    fast = workloads.trace(TOKENIZER, path=EXAMPLE_TRACE, time_scale=0.5, num_requests=5)
    assert [r.arrival_time for r in fast] == [r.arrival_time * 0.5 for r in full[:5]]


def test_write_trace_round_trips(tmp_path):
    original = _build("multi_turn", 0) + _build("rl_group", 0)
    path = tmp_path / "saved.jsonl"
    workloads.write_trace(original, path)
    assert workloads.trace(TOKENIZER, path=path) == sorted(original,
                                                           key=lambda r: r.arrival_time)


@pytest.mark.parametrize("bad_line, message", [
    ('{"arrival_time": 1.0, "prompt_len": 5}', "missing required field 'output_len'"),
    ('{"arrival_time": 1.0, "prompt_len": 5, "prompt_ids": [1], "output_len": 3}',
     "exactly one of 'prompt_ids' and 'prompt_len'"),
    ('{"arrival_time": 1.0, "output_len": 3}', "exactly one of 'prompt_ids' and 'prompt_len'"),
    ('{"arrival_time": -2, "prompt_len": 5, "output_len": 3}', "'arrival_time' must be >= 0"),
    ('{"arrival_time": "soon", "prompt_len": 5, "output_len": 3}', "'arrival_time'"),
    ('{"arrival_time": 1.0, "prompt_len": 5, "output_len": 0}', "'output_len' must be >= 1"),
    ('{"arrival_time": 1.0, "prompt_len": 5.5, "output_len": 3}', "'prompt_len' must be a"),
    ('{"arrival_time": 1.0, "prompt_ids": [1, -4], "output_len": 3}', "'prompt_ids'"),
    ('{"arrival_time": 1.0, "prompt_len": 5, "output_len": 3, "n": true}', "'n' must be a"),
    ('{"arrival_time": 1.0, "prompt_len": 5, "output_len": 3, "tennant": "a"}', "tennant"),
    ('{"arrival_time": 1.0, "prompt_len": 5, "output_len": 3', "invalid JSON"),
    ('[1, 2, 3]', "expected a JSON object"),
])
def test_trace_errors_name_the_line_and_field(tmp_path, bad_line, message):
    good = '{"arrival_time": 0.5, "prompt_len": 4, "output_len": 2}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good, "", good, bad_line, good]) + "\n")
    with pytest.raises(ValueError, match=re.escape("bad.jsonl:4: ") + ".*" + re.escape(message)):
        workloads.trace(TOKENIZER, path=path)


def test_trace_rejects_duplicate_request_ids(tmp_path):
    line = '{"arrival_time": 0.5, "prompt_len": 4, "output_len": 2, "request_id": "x"}'
    path = tmp_path / "dup.jsonl"
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(ValueError, match="duplicate"):
        workloads.trace(TOKENIZER, path=path)
