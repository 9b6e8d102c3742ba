"""Routing policies and prefill/decode disaggregation on multi-instance traces.

  python scripts/bench_router.py --output_dir /tmp/bench_router
  python scripts/bench_router.py --num_instances 4 --num_requests 64 --output_dir /tmp/br4

Every instance is an in-process engine with its own simulated clock (`kvjax.router.replay`):
a step advances only its own instance's clock by the step's measured cost (CPU seconds by
default), so instances run "side by side" as if on separate hardware while the host runs them
one at a time. The numbers compare routing quality (prefix hits, queueing, balance), not
parallel speed-up.

Two traces (`kvjax.bench.workloads`): shared_prefix (a few long system prompts shared by
most requests) and multi_tenant_burst (four tenants, one flooding; tenants never share KV).
Each runs through every routing policy; shared_prefix also runs colocated on one and two
instances and disaggregated (one prefill + one decode instance).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time

import jax
from absl import app, flags

from kvjax import EngineConfig, SamplingParams
from kvjax.bench import metrics as bench_metrics
from kvjax.bench import workloads
from kvjax.config import ModelConfig
from kvjax.engine.engine import Engine
from kvjax.models import llama
from kvjax.models.model import Model
from kvjax.router import (
    POLICIES,
    Arrival,
    DisaggregatedEngine,
    Router,
    SimClock,
    replay,
    replay_disaggregated,
)

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "random", ["random", "embedded"],
                  "A random Llama of SmolLM2's vocabulary and GQA shape, small enough for a "
                  "shared CPU, or the embedded SmolLM2-135M itself.")
flags.DEFINE_integer("num_instances", 2, "Engine instances behind the router.")
flags.DEFINE_integer("num_requests", 48, "Requests per trace.")
flags.DEFINE_float("rate", 24.0, "Mean arrival rate, requests per simulated second.")
flags.DEFINE_integer("prefix_len", 256, "shared_prefix: tokens of each shared system prompt.")
flags.DEFINE_integer("num_prefixes", 4, "shared_prefix: distinct shared system prompts.")
flags.DEFINE_integer("output_len", 16, "Tokens generated per request.")
flags.DEFINE_integer("seed", 0, "Trace and model seed.")
flags.DEFINE_enum("clock", "cpu", ["cpu", "wall"],
                  "What a step costs on its instance's simulated clock: the process's CPU "
                  "seconds (steady on a shared machine) or wall seconds.")
flags.DEFINE_string("output_dir", None, "Writes results.json and tables.md here.")

# SmolLM2's vocabulary (its tokenizer builds the prompts) and GQA ratio, at a size the shared
# CPU runs a trace of through every policy in minutes.
RANDOM_CONFIG = ModelConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024,
                            num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                            max_position_embeddings=2048, tie_word_embeddings=True,
                            eos_token_ids=(2,), name="random-smollm2-shape")
ENGINE_CONFIG = EngineConfig(page_size=16, num_pages=1024, max_num_seqs=8,
                             max_num_batched_tokens=512, max_prefill_chunk=256,
                             max_prefill_seqs=4, min_chunk_bucket=64, max_model_len=1024)
TABLE_COLUMNS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tok_s",
                 "prefix_hit_rate", "preemptions", "config.per_instance")
DISAGG_COLUMNS = TABLE_COLUMNS[:-1] + ("config.transfer_mib", "config.transfer_ms_mean")


def load_tokenizer():
    """SmolLM2's tokenizer, read from the embedded GGUF's metadata (no weights)."""
    import gguf

    from kvjax.models.gguf import read_metadata
    from kvjax.models.loading import embedded_model_path
    from kvjax.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(embedded_model_path())))


def build_model(name: str, seed: int) -> Model:
    if name == "embedded":
        from kvjax.models.loading import load_model

        return load_model(None, "float32")
    params = llama.init_params(RANDOM_CONFIG, jax.random.PRNGKey(seed), scale=0.05)
    return Model(config=RANDOM_CONFIG, params=params, source="random")


def make_traces(tokenizer, num_requests: int, rate: float, seed: int) -> dict[str, list]:
    shared = workloads.shared_prefix(
        tokenizer, seed=seed, num_requests=num_requests, rate=rate, shared_fraction=0.875,
        num_prefixes=FLAGS.num_prefixes, prefix_len=FLAGS.prefix_len, question_min=16,
        question_max=64, output_len=FLAGS.output_len)
    burst = workloads.multi_tenant_burst(
        tokenizer, seed=seed, num_requests=num_requests, num_tenants=4, base_rate=rate / 4,
        burst_multiplier=4.0, prompt_len=192, output_len=FLAGS.output_len)
    # Log-normal prompts have a long tail: cut them to fit the engines' context.
    limit = ENGINE_CONFIG.max_model_len - 2 * FLAGS.output_len
    burst = [dataclasses.replace(r, prompt_ids=r.prompt_ids[:limit]) for r in burst]
    return dict(shared_prefix=shared, multi_tenant_burst=burst)


def _arrivals(requests, start: float) -> list[Arrival]:
    return [Arrival(r.request_id, start + r.arrival_time, r.prompt_ids,
                    SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True),
                    tenant=r.tenant) for r in requests]


def _fresh(engines: list[Engine]) -> float:
    """Empties the instances' prefix caches; returns the simulated time to start at."""
    for engine in engines:
        engine.allocator.reset_prefix_cache()
    return max(engine.clock() for engine in engines)


def summarize(name: str, outputs, requests, extra: dict) -> dict:
    """compute_metrics over a replay's outputs (prefix hit rate from the requests' own hits)."""
    by_id = {r.request_id: r for r in requests}
    records = []
    for out in outputs:
        sample = out.outputs[0]
        records.append(bench_metrics.RequestRecord(
            request_id=out.request_id, tenant=by_id[out.request_id].tenant,
            arrival_time=out.arrival_time, first_token_time=out.first_token_time,
            token_times=list(out.token_times), finish_time=out.finish_time,
            num_prompt_tokens=len(out.prompt_ids), num_output_tokens=len(sample.token_ids),
            error=out.error, num_cached_prompt_tokens=out.num_cached_prompt_tokens))
    start = min(r.arrival_time for r in records)
    duration = max(r.finish_time for r in records) - start
    counters = dict(prefix_hit_tokens=sum(r.num_cached_prompt_tokens for r in records),
                    prefix_query_tokens=sum(r.num_prompt_tokens for r in records),
                    preemptions=extra.pop("preemptions"),
                    compiles_after_warmup=extra.pop("compiles_after_warmup"))
    return bench_metrics.compute_metrics(
        records, slo_ttft_s=1.0, slo_tpot_s=0.1, duration_s=duration, counters=counters,
        config=dict(name=name, **extra), clock=bench_metrics.Clock.SIMULATED)


def _engine_counts(engines: list[Engine]) -> tuple[int, int]:
    return sum(e.stats["preemptions"] for e in engines), sum(e.num_compiles for e in engines)


def run_routed(name: str, engines: list[Engine], policy: str, requests) -> dict:
    start = _fresh(engines)
    preemptions, compiles = _engine_counts(engines)
    router = Router(engines, policy)
    outputs = replay(router, _arrivals(requests, start))
    counts = collections.Counter(router.routed_to.values())
    after = _engine_counts(engines)
    return summarize(name, outputs, requests, dict(
        policy=policy, instances=len(engines),
        per_instance="/".join(str(counts[i]) for i in range(len(engines))),
        preemptions=after[0] - preemptions, compiles_after_warmup=after[1] - compiles))


def run_disaggregated(name: str, prefill: Engine, decode: Engine, requests) -> dict:
    server = DisaggregatedEngine(prefill, decode)  # commits the decode KV: warm up again
    server.warmup(max(len(r.prompt_ids) for r in requests))
    start = _fresh([prefill, decode])
    preemptions, compiles = _engine_counts([prefill, decode])
    transfer_compiles = server.num_compiles
    outputs = replay_disaggregated(server, _arrivals(requests, start))
    after = _engine_counts([prefill, decode])
    stats = server.stats
    return summarize(name, outputs, requests, dict(
        policy="disaggregated", instances=2, per_instance="prefill/decode",
        transfer_mib=stats["transfer_bytes"] / 2**20, transfers=stats["transfers"],
        transfer_ms_mean=1e3 * stats["transfer_time_s"] / max(stats["transfers"], 1),
        transferred_tokens=stats["transferred_tokens"], reused_tokens=stats["reused_tokens"],
        preemptions=after[0] - preemptions,
        compiles_after_warmup=after[1] - compiles + server.num_compiles - transfer_compiles))


def main(argv):
    del argv
    t0 = time.perf_counter()
    tokenizer = load_tokenizer()
    model = build_model(FLAGS.model, FLAGS.seed)
    traces = make_traces(tokenizer, FLAGS.num_requests, FLAGS.rate, FLAGS.seed)
    timer = time.process_time if FLAGS.clock == "cpu" else time.perf_counter
    engines = [Engine(model, ENGINE_CONFIG, clock=SimClock(timer=timer))
               for _ in range(max(FLAGS.num_instances, 2))]
    for engine in engines:
        engine.warmup()
    print(f"warm-up: {time.perf_counter() - t0:.0f}s, {engines[0].num_compiles} programs "
          f"per instance", flush=True)
    results = collections.defaultdict(list)
    instances = engines[:FLAGS.num_instances]
    for trace_name, requests in traces.items():
        for policy in sorted(POLICIES):
            results[trace_name].append(run_routed(policy, instances, policy, requests))
            print(trace_name, policy, f"{time.perf_counter() - t0:.0f}s", flush=True)
    shared = traces["shared_prefix"]
    results["disaggregation"] = [
        run_routed("colocated x1", engines[:1], "round_robin", shared),
        run_routed("colocated x2 (load_aware)", engines[:2], "load_aware", shared),
        run_disaggregated("disaggregated 1P+1D", engines[0], engines[1], shared),
    ]
    tables = []
    for section, runs in results.items():
        columns = DISAGG_COLUMNS if section == "disaggregation" else TABLE_COLUMNS
        tables.append(f"### {section}\n\n{bench_metrics.format_table(runs, columns)}\n")
    text = "\n".join(tables)
    print(text)
    if FLAGS.output_dir:
        os.makedirs(FLAGS.output_dir, exist_ok=True)
        with open(os.path.join(FLAGS.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(FLAGS.output_dir, "tables.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    app.run(main)
