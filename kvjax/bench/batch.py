"""Offline batch inference benchmark: orderings side by side, and prefill-only reach.

Two workloads with shared structure, written as batch JSONL:

  * `corpus_questions`: documents of the local corpus, each asked several questions; lines
    are shuffled, so input order rarely puts two questions on one document side by side.
  * `table_records`: rows with a unique `id` field first and low-cardinality fields after it
    (LLMQueryReordering's setting): rows share a prefix only once fields are reordered.

`compare_orders` runs the same lines under each ordering on a fresh engine and reports batch
completion time, prefill tokens computed and the prefix hit rate; `prefill_only_reach`
finds the longest input the engine's KV pool admits and the longest the layer-by-layer
scorer scores under the same KV bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from kvjax.batch import PrefillOnlyScorer, run_batch
from kvjax.bench.corpus import make_corpus
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams

_QUESTIONS = ("Summarize the text.", "Who is named?", "List three facts.", "Give a title.",
              "What happens first?", "Translate the first line.", "Name the topic.",
              "What is the tone?")
_TABLE_FIELDS = {"region": ("north", "south", "east", "west"),
                 "category": ("books", "garden", "kitchen", "toys", "tools", "music"),
                 "status": ("shipped", "returned", "pending")}


def corpus_questions(num_requests: int, *, seed: int = 0, questions_per_doc: int = 8,
                     max_tokens: int = 4) -> list[dict]:
    """Batch lines asking `questions_per_doc` questions about each corpus document, shuffled."""
    docs = make_corpus(seed, -(-num_requests // questions_per_doc), min_words=30,
                       max_words=60)
    lines = [{"id": f"doc{d}-q{q}", "prompt": f"{doc}\nQ: {_QUESTIONS[q % len(_QUESTIONS)]}",
              "max_tokens": max_tokens} for d, doc in enumerate(docs)
             for q in range(questions_per_doc)][:num_requests]
    np.random.default_rng(seed).shuffle(lines)
    return lines


def table_records(num_requests: int, *, seed: int = 0, max_tokens: int = 4) -> list[dict]:
    """Batch lines classifying table rows: a unique `id` field first, shared fields after."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_requests):
        record = {"order_id": f"{rng.integers(10**7, 10**8)}"}
        record.update({f: str(rng.choice(v)) for f, v in _TABLE_FIELDS.items()})
        record["note"] = str(rng.choice(["fragile item, handle with care", "gift wrap",
                                         "leave at the door", "none"]))
        lines.append({"id": f"row{i}", "instruction": "Is this order at risk? Answer yes or no.",
                      "record": record, "max_tokens": max_tokens})
    return lines


def compare_orders(model: Model, lines: list[dict], orders: list[str],
                   config: EngineConfig) -> dict[str, dict]:
    """Runs `lines` under each ordering from scratch; returns per ordering: seconds (batch
    completion), prefill_tokens, prompt_tokens, prefix_hit_rate, generated_tokens, and
    whether its greedy tokens equal input order's (`same_tokens_as_input`; the `fields`
    ordering rewrites prompts, so it is expected to differ there)."""
    results, tokens = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        for order in orders:
            out = os.path.join(tmp, f"{order}.jsonl")
            stats = run_batch(model, path, out, order=order, engine_config=config)
            with open(out) as f:
                tokens[order] = {r["id"]: r.get("tokens") for r in map(json.loads, f)}
            results[order] = dict(
                seconds=round(stats.seconds, 2), prefill_tokens=stats.prefill_tokens,
                prompt_tokens=stats.prompt_tokens,
                prefix_hit_rate=round(stats.prefix_hit_rate, 3),
                generated_tokens=stats.generated_tokens, num_errors=stats.num_errors,
                same_tokens_as_input=tokens[order] == tokens.get("input", tokens[order]))
    return results


def prefill_only_reach(model: Model, config: EngineConfig, *, chunk: int = 128) -> dict:
    """The longest input a normal engine admits against what prefill-only scores, at one
    KV budget (the engine's pool); both limits are checked by running them."""
    engine = Engine(model, config)
    budget = engine.num_pages * engine.kv_bytes_per_page
    normal = engine.num_pages * config.page_size - 1  # One token must be generated.
    engine.validate_request("normal", [3] * normal, SamplingParams(max_new_tokens=1))
    scorer = PrefillOnlyScorer(model, kv_budget_bytes=budget, chunk=chunk)
    tokens = np.random.default_rng(0).integers(3, 100, scorer.max_tokens).tolist()
    rejected = _rejects(engine, tokens)
    logprobs = scorer.score("long", tokens[:-8], tokens[-8:])
    return dict(kv_budget_bytes=budget, num_layers=model.config.num_layers,
                normal_max_tokens=normal, prefill_only_max_tokens=scorer.max_tokens,
                engine_rejects_prefill_only_max=rejected,
                prefill_only_scored=bool(np.all(np.isfinite(logprobs))))


def _rejects(engine: Engine, tokens: list[int]) -> bool:
    try:
        engine.validate_request("long", tokens, SamplingParams(max_new_tokens=1))
    except ValueError:
        return True
    return False


def bench_config(num_pages: int, max_num_seqs: int) -> EngineConfig:
    """The engine both comparisons use (16-token pages, prefix cache on)."""
    return dataclasses.replace(EngineConfig(), num_pages=num_pages, max_num_seqs=max_num_seqs)
