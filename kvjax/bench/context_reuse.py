"""Non-prefix context reuse on RAG prompts: time to first token, tokens computed and quality
per strategy (`kvjax.scheduler.context`), side by side.

One engine per strategy serves the same `rag` workload (`kvjax.bench.workloads.rag`) one
request at a time, the engines taking turns request by request so machine noise hits every
strategy alike. Per strategy: TTFT p50/p99 (chunk fills on a miss included), prefill tokens
computed (chunk fills and CacheBlend recomputes included), the chunk hit rate (chunk
occurrences served without computing the chunk), answer accuracy (the planted code in the
greedy output) and, over the answer tokens of the first `quality_requests` requests, the KL
divergence from full prefill: each engine decodes full prefill's greedy answer teacher-forced
and the distributions of every answer position are compared.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

import kvjax
from kvjax.bench.quant import token_stats
from kvjax.bench.workloads import BenchRequest, rag
from kvjax.engine.request import SeqStatus
from kvjax.engine.step import LogitsMode

DEFAULT_STRATEGIES = ("full", "none", "ape", "epic", "cacheblend")


@dataclasses.dataclass(frozen=True)
class ReuseBench:
    """What the benchmark runs (the flags of scripts/bench_context_reuse.py)."""

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    options: dict = dataclasses.field(default_factory=dict)  # strategy -> its options
    num_requests: int = 32
    num_docs: int = 16
    docs_per_prompt: int = 3
    doc_min_words: int = 80
    doc_max_words: int = 160
    popularity: float = 1.0
    output_len: int = 8
    quality_requests: int = 16
    page_size: int = 16
    num_pages: int = 1024  # per engine: room for every document and the requests' own pages
    max_prefill_chunk: int = 512
    seed: int = 0


def make_engine(model: kvjax.Model, strategy: str, options: dict, settings: ReuseBench,
                max_len: int) -> kvjax.Engine:
    config = kvjax.EngineConfig(
        page_size=settings.page_size, max_model_len=max_len, max_num_seqs=8,
        num_pages=settings.num_pages,
        max_prefill_chunk=settings.max_prefill_chunk,
        max_num_batched_tokens=settings.max_prefill_chunk, max_prefill_seqs=4,
        context_reuse=strategy, context_reuse_options=options)
    engine = kvjax.Engine(model, config)
    engine.warmup()
    return engine


def serve_one(engine: kvjax.Engine, request: BenchRequest, request_id: str
              ) -> kvjax.RequestOutput:
    engine.add_request(request_id, request.segments(), kvjax.SamplingParams(
        max_new_tokens=request.max_new_tokens, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out


def forced_answer_logits(engine: kvjax.Engine, request: BenchRequest, forced: Sequence[int],
                         request_id: str) -> np.ndarray:
    """Logits [len(forced), V] of each answer position, the answer teacher-forced."""
    engine.add_request(request_id, request.segments(), kvjax.SamplingParams(
        max_new_tokens=len(forced), ignore_eos=True))
    seq_id = f"{request_id}#0"
    seq = engine.sequence(seq_id)
    num_prompt = len(request.prompt_ids)
    logits = []
    while engine.has_unfinished():
        before = len(seq.tokens)
        engine.step(logits_mode=LogitsMode.LAST)
        if len(seq.tokens) > before:
            row = dict(engine.last_sampled_rows)[seq_id]
            logits.append(np.asarray(engine.last_logits[row], np.float64))
            i = len(seq.tokens) - 1 - num_prompt
            if i < len(forced) and seq.status is not SeqStatus.FINISHED:
                engine.force_token(seq_id, forced[i])
    return np.stack(logits)


_COUNTERS = ("prefill_tokens", "chunk_fill_tokens", "chunk_reused_tokens", "chunk_hits",
             "chunk_lookups", "chunk_fills", "blend_tokens")


def run(model: kvjax.Model, settings: ReuseBench) -> dict:
    workload = rag(model.tokenizer, seed=settings.seed, num_requests=settings.num_requests,
                   num_docs=settings.num_docs, docs_per_prompt=settings.docs_per_prompt,
                   doc_min_words=settings.doc_min_words, doc_max_words=settings.doc_max_words,
                   popularity=settings.popularity, output_len=settings.output_len)
    longest = max(len(r.prompt_ids) for r in workload) + settings.output_len
    max_len = -(-(longest + 1) // 256) * 256
    if "full" not in settings.strategies:
        raise ValueError("the strategies must include 'full' (the quality reference)")
    engines = {s: make_engine(model, s, settings.options.get(s, {}), settings, max_len)
               for s in settings.strategies}
    before = {s: {k: e.stats.get(k, 0) for k in _COUNTERS} for s, e in engines.items()}
    compiles = {s: e.num_compiles for s, e in engines.items()}
    ttft = {s: [] for s in engines}
    correct = {s: 0 for s in engines}
    outputs = {s: [] for s in engines}
    wall = {s: 0.0 for s in engines}
    for request in workload:
        for s, engine in engines.items():
            start = time.perf_counter()
            out = serve_one(engine, request, f"{request.request_id}-{s}")
            wall[s] += time.perf_counter() - start
            ttft[s].append(out.first_token_time - out.arrival_time)
            text = model.tokenizer.decode(out.outputs[0].token_ids)
            correct[s] += request.answer in text
            outputs[s].append(out.outputs[0].token_ids)
    chunk_occurrences = sum(len(r.reuse_spans) for r in workload)
    timed_compiles = {s: e.num_compiles - compiles[s] for s, e in engines.items()}
    timed = {s: {k: e.stats.get(k, 0) - before[s][k] for k in _COUNTERS}
             for s, e in engines.items()}
    quality = {}
    for i, request in enumerate(workload[:settings.quality_requests]):
        forced = outputs["full"][i]
        ref = forced_answer_logits(engines["full"], request, forced, f"q{i}-full")
        for s, engine in engines.items():
            test = forced_answer_logits(engine, request, forced, f"q{i}-{s}")
            st = token_stats(ref, test, np.asarray(forced))
            quality.setdefault(s, []).append(st)
    results = []
    for s, engine in engines.items():
        delta = timed[s]
        kl = np.concatenate([q["kl"] for q in quality[s]])
        agree = np.concatenate([q["agree"] for q in quality[s]])
        t = np.asarray(ttft[s]) * 1e3
        results.append(dict(
            strategy=s, options=settings.options.get(s, {}),
            ttft_p50_ms=float(np.percentile(t, 50)), ttft_p99_ms=float(np.percentile(t, 99)),
            ttft_mean_ms=float(t.mean()), wall_s=wall[s],
            prefill_tokens=int(delta["prefill_tokens"]),
            chunk_fill_tokens=int(delta["chunk_fill_tokens"]),
            reused_tokens=int(delta["chunk_reused_tokens"]),
            blend_tokens=int(delta["blend_tokens"]),
            chunk_hit_rate=(1.0 - delta["chunk_fills"] / chunk_occurrences
                            if engine.context_reuse.reuses else 0.0),
            accuracy=correct[s] / len(workload),
            kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
            kl_max=float(kl.max()), top1_agreement=float(agree.mean()),
            compiles_after_warmup=timed_compiles[s]))
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    return dict(results=results, prompt_tokens=prompt_tokens,
                chunk_occurrences=chunk_occurrences, num_requests=len(workload),
                quality_tokens=int(sum(len(o) for o in outputs["full"][
                    :settings.quality_requests])))


_COLUMNS = (("strategy", "strategy", "{}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
            ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("prefill_tokens", "prefill tok", "{}"),
            ("chunk_hit_rate", "chunk hits", "{:.2f}"), ("kl_mean", "KL mean", "{:.3f}"),
            ("kl_p99", "KL p99", "{:.3f}"), ("kl_max", "KL max", "{:.3f}"),
            ("top1_agreement", "top-1", "{:.2f}"), ("accuracy", "accuracy", "{:.2f}"))


def format_table(results: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(c[1] for c in _COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join(fmt.format(r[key]) for key, _, fmt in _COLUMNS) + " |")
    return "\n".join(lines)
