"""Engine memory and scheduling numbers: paged against contiguous KV, and the prefix cache.

  python scripts/bench_engine.py --output_json docs/results/bench_engine.json

All parts run the embedded SmolLM2-135M (float32) on corpus-text workloads from
`kvjax.bench.workloads`:

  1. KV memory and concurrency: one workload of varied prompt and output lengths (log-normal,
     all submitted at t=0) runs on a paged engine (16-token pages) and on a contiguous engine
     (max_model_len reserved per sequence) with the same KV byte budget. Each step records live
     and reserved KV bytes (`engine.kv_samples`) and the running sequences (`num_running`):
     utilization at peak load, and the most sequences the budget held at once.
  2. Shared system prompt: a `shared_prefix` workload replayed in real time (Poisson arrivals)
     with and without the prefix cache: prefix hit rate and time to first token. Both engines
     compile every step shape before the clock starts (`Engine.warmup`).
  3. Host overhead: a batch of `--host_batch` sequences decoding; the engine's host time per
     step (scheduling, input building, commit) against the step's wall time.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import kvjax
from kvjax import testing
from kvjax.bench import host_tiers, metrics
from kvjax.bench.workloads import BenchRequest, poisson, shared_prefix

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["memory", "prefix", "host"], "Which parts to run.")
flags.DEFINE_integer("max_model_len", 512, "Context length (contiguous reserves this much).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("budget_seqs", 8, "KV byte budget of part 1, in full-length sequences.")
flags.DEFINE_integer("max_num_seqs", 64, "Part 1's cap on running sequences (both layouts).")
flags.DEFINE_integer("memory_requests", 48, "Requests of the part 1 workload.")
flags.DEFINE_integer("prompt_median", 96, "Log-normal median prompt length (part 1).")
flags.DEFINE_integer("output_median", 48, "Log-normal median output length (part 1).")
flags.DEFINE_integer("prefix_requests", 16, "Requests of the shared-prefix workload.")
flags.DEFINE_float("prefix_rate", 0.5, "Arrivals per second of the shared-prefix workload.")
flags.DEFINE_integer("prefix_len", 256, "Shared system prompt length.")
flags.DEFINE_integer("prefix_output_len", 16, "Output tokens per shared-prefix request.")
flags.DEFINE_integer("host_batch", 32, "Batch size of part 3.")
flags.DEFINE_integer("host_new_tokens", 48, "Tokens each part 3 sequence generates.")
flags.DEFINE_enum("host_model", "embedded", ["embedded", "tiny"],
                  "Part 3's model: the embedded one, or kvjax.testing's tiny model (a short "
                  "device step, so the host's share of a step shows).")
flags.DEFINE_integer("host_repeats", 3, "Part 3 runs per scheduling mode (medians reported).")
flags.DEFINE_bool("host_tiers", False, "Part 3 also measures a multi-turn chat through a "
                  "host tier (tiny model), sync and async.")
flags.DEFINE_integer("host_tier_conversations", 4, "Conversations of the --host_tiers chat.")
flags.DEFINE_integer("host_tier_turns", 3, "Turns per --host_tiers conversation.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_json", None, "Write the results here.")


def _kv_bytes_per_token(model: kvjax.Model) -> int:
    return model.config.kv_bytes_per_token(model.dtype)


def _ttfts(outputs: list[kvjax.RequestOutput]) -> list[float]:
    return [o.first_token_time - o.arrival_time for o in outputs]


def _records(outputs: list[kvjax.RequestOutput]) -> list[metrics.RequestRecord]:
    return [metrics.RequestRecord(
        request_id=o.request_id, tenant=o.tenant, arrival_time=o.arrival_time,
        first_token_time=o.first_token_time, token_times=list(o.token_times),
        finish_time=o.finish_time, num_prompt_tokens=len(o.prompt_ids),
        num_output_tokens=len(o.outputs[0].token_ids), error=o.error,
        num_cached_prompt_tokens=o.num_cached_prompt_tokens) for o in outputs]


def run_workload(engine: kvjax.Engine, requests: list[BenchRequest], *, real_time: bool
                 ) -> tuple[list[kvjax.RequestOutput], list[int], float]:
    """Serves `requests` (arriving at their times if `real_time`, else all at once).

    Returns (outputs in request order, running sequences after each step, duration in s).
    """
    pending = sorted(requests, key=lambda r: r.arrival_time)
    start = time.perf_counter()
    running, outputs = [], {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and (not real_time or pending[0].arrival_time <= now):
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt_ids, kvjax.SamplingParams(
                max_new_tokens=r.max_new_tokens, ignore_eos=True),
                arrival_time=start + (r.arrival_time if real_time else 0.0))
        if not engine.has_unfinished():
            time.sleep(max(pending[0].arrival_time - now, 0.0))
            continue
        outputs.update({o.request_id: o for o in engine.step()})
        running.append(engine.num_running)
    duration = time.perf_counter() - start
    return [outputs[r.request_id] for r in requests], running, duration


def _utilization(kv_samples: list[tuple[float, int, int]], time_weighted_mean: float) -> dict:
    """Live / reserved KV bytes at peak load and over the run."""
    samples = np.asarray(kv_samples, np.float64)  # [steps, 3]
    live, reserved = samples[:, 1], samples[:, 2]
    peak = reserved >= 0.9 * reserved.max()  # steps within 10% of the most reserved bytes
    busy = reserved > 0
    return dict(at_peak_load=float(np.mean(live[peak] / reserved[peak])),
                peak_load_steps=int(peak.sum()),
                at_max_reserved=float(live[np.argmax(reserved)] / reserved.max()),
                step_mean=float(np.mean(live[busy] / reserved[busy])),
                time_weighted_mean=time_weighted_mean, max_live_bytes=int(live.max()),
                max_reserved_bytes=int(reserved.max()))


def part_memory(model: kvjax.Model) -> dict:
    """Part 1: KV utilization and concurrency, paged vs contiguous, one workload and budget."""
    requests = poisson(model.tokenizer, seed=FLAGS.seed, num_requests=FLAGS.memory_requests,
                       rate=math.inf, prompt_len=FLAGS.prompt_median, prompt_sigma=0.7,
                       prompt_min=16, prompt_max=FLAGS.max_model_len // 2,
                       output_len=FLAGS.output_median, output_sigma=0.7, output_min=8,
                       output_max=FLAGS.max_model_len // 4)
    budget = FLAGS.budget_seqs * FLAGS.max_model_len * _kv_bytes_per_token(model)
    result = dict(
        workload=dict(num_requests=len(requests),
                      prompt_tokens=_stats([len(r.prompt_ids) for r in requests]),
                      output_tokens=_stats([r.max_new_tokens for r in requests])),
        kv_budget_bytes=budget, max_model_len=FLAGS.max_model_len,
        max_num_seqs=FLAGS.max_num_seqs)
    for layout in (kvjax.KVLayout.PAGED, kvjax.KVLayout.CONTIGUOUS):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            kv_layout=layout, page_size=FLAGS.page_size, kv_budget_bytes=budget,
            max_num_seqs=FLAGS.max_num_seqs, max_model_len=FLAGS.max_model_len,
            enable_prefix_cache=False))
        outputs, running, duration = run_workload(engine, requests, real_time=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        run = metrics.compute_metrics(_records(outputs), slo_ttft_s=math.inf,
                                      slo_tpot_s=math.inf, duration_s=duration,
                                      kv_samples=engine.kv_samples)
        result[layout.value] = dict(
            utilization=_utilization(engine.kv_samples, run["kv_utilization_mean"]),
            max_running=max(running), mean_running=float(np.mean(running)),
            steps=engine.stats["steps"], preemptions=engine.stats["preemptions"],
            pool_bytes=int(engine.kv.nbytes()),
            duration_s=duration, output_tokens=tokens, tokens_per_s=tokens / duration,
            failed=sum(o.error is not None for o in outputs))
        print(f"{layout.value}: {result[layout.value]}", flush=True)
    return result


def _stats(values: list[float]) -> dict:
    a = np.asarray(values, np.float64)
    return dict(mean=float(a.mean()), p50=float(np.median(a)), min=float(a.min()),
                max=float(a.max()))


def part_prefix(model: kvjax.Model) -> dict:
    """Part 2: shared system prompt, with and without the prefix cache."""
    requests = shared_prefix(model.tokenizer, seed=FLAGS.seed,
                             num_requests=FLAGS.prefix_requests, rate=FLAGS.prefix_rate,
                             prefix_len=FLAGS.prefix_len, question_min=16, question_max=64,
                             output_len=FLAGS.prefix_output_len)
    result = dict(workload=dict(num_requests=len(requests), rate=FLAGS.prefix_rate,
                                prefix_len=FLAGS.prefix_len, shared_fraction=0.8,
                                output_len=FLAGS.prefix_output_len))
    for enabled in (False, True):
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            page_size=FLAGS.page_size, max_num_seqs=8, max_prefill_seqs=1,
            max_model_len=FLAGS.max_model_len, enable_prefix_cache=enabled))
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        compiles = engine.num_compiles
        outputs, running, duration = run_workload(engine, requests, real_time=True)
        ttfts = _ttfts(outputs)
        prefix = engine.prefix_cache_stats()
        run = metrics.compute_metrics(
            _records(outputs), slo_ttft_s=math.inf, slo_tpot_s=math.inf, duration_s=duration,
            counters={k: prefix[k] for k in ("prefix_hit_tokens", "prefix_query_tokens")})
        result["cache_on" if enabled else "cache_off"] = dict(
            prefix_hit_rate=run["prefix_hit_rate"] or 0.0,
            cached_prompt_tokens=sum(o.num_cached_prompt_tokens for o in outputs),
            prompt_tokens=sum(len(o.prompt_ids) for o in outputs),
            ttft_mean_s=float(np.mean(ttfts)), ttft_p50_s=run["ttft_p50_s"],
            ttft_p99_s=run["ttft_p99_s"], tpot_p50_s=run["tpot_p50_s"],
            duration_s=duration, warmup_s=warmup_s, max_running=max(running),
            compiles_after_warmup=engine.num_compiles - compiles, **prefix)
        print(f"prefix cache {'on' if enabled else 'off'}: "
              f"{result['cache_on' if enabled else 'cache_off']}", flush=True)
    return result


def _host_steps(model: kvjax.Model, prompts: list[list[int]], *, is_async: bool) -> dict:
    """Full-batch decode steps of one engine: host work, device wait and wall time per step."""
    batch, new_tokens = len(prompts), FLAGS.host_new_tokens
    engine = kvjax.Engine(model, kvjax.EngineConfig(
        page_size=FLAGS.page_size, max_num_seqs=batch, max_model_len=32 + new_tokens,
        enable_prefix_cache=False, async_scheduling=is_async))
    engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=new_tokens // 2,
                                                  ignore_eos=True))  # compiles every shape
    sampling = kvjax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-{i}", prompt, sampling)
    host, wait, wall, outputs = [], [], [], {}
    while engine.has_unfinished():
        before, compiles = dict(engine.stats), engine.num_compiles
        start = time.perf_counter()
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        elapsed = time.perf_counter() - start
        stats = engine.stats
        if (stats["decode_tokens"] - before["decode_tokens"] == batch and
                stats["prefill_tokens"] == before["prefill_tokens"] and
                engine.num_compiles == compiles):
            host.append(stats["host_time_s"] - before["host_time_s"])
            wait.append(stats["step_time_s"] - before["step_time_s"])
            wall.append(elapsed)
    return dict(decode_steps=len(wall), host_ms_per_step=1e3 * float(np.mean(host)),
                device_wait_ms_per_step=1e3 * float(np.mean(wait)),
                wall_ms_per_step=1e3 * float(np.mean(wall)),
                host_fraction_of_wall=float(np.sum(host) / np.sum(wall)),
                tokens=[outputs[f"host-{i}"] for i in range(batch)])


def part_host(model: kvjax.Model) -> dict:
    """Part 3: host time per full-batch decode step, synchronous vs asynchronous scheduling.

    Sync, the device waits while the host schedules, builds the next step's inputs and commits
    the last one's tokens; async, the host does that while the device runs the step in flight.
    The wall time saved per step over the sync host time is the share of host work hidden.
    """
    if FLAGS.host_model == "tiny":
        model = testing.tiny_model()
    prompts = [list(r.prompt_ids) for r in poisson(
        _host_tokenizer(model), seed=FLAGS.seed + 1, num_requests=FLAGS.host_batch,
        rate=math.inf, prompt_dist="fixed", prompt_len=32, prompt_min=1, prompt_max=32,
        output_dist="fixed", output_len=FLAGS.host_new_tokens, output_min=1,
        output_max=FLAGS.host_new_tokens)]
    runs = {}
    for _ in range(FLAGS.host_repeats):  # Interleaved, so load drifts hit both modes alike.
        for mode in ("sync", "async"):
            runs.setdefault(mode, []).append(_host_steps(model, prompts,
                                                         is_async=mode == "async"))
    result = dict(batch=FLAGS.host_batch, model=model.config.name, repeats=FLAGS.host_repeats)
    for mode, reps in runs.items():
        result[mode] = {key: float(np.median([r[key] for r in reps])) for key in (
            "host_ms_per_step", "device_wait_ms_per_step", "wall_ms_per_step",
            "host_fraction_of_wall")}
        result[mode]["decode_steps"] = reps[0]["decode_steps"]
    sync, asyn = result["sync"], result["async"]
    result["identical_tokens"] = all(r["tokens"] == runs["sync"][0]["tokens"]
                                     for reps in runs.values() for r in reps)
    result["wall_saved_ms_per_step"] = sync["wall_ms_per_step"] - asyn["wall_ms_per_step"]
    result["host_hidden_fraction"] = result["wall_saved_ms_per_step"] / sync["host_ms_per_step"]
    if FLAGS.host_tiers:
        result["tiers"] = part_host_tiers()
    return result


def part_host_tiers() -> dict:
    """Host ms per step of a multi-turn chat through a host tier, sync and async."""
    model = testing.tiny_model()
    rounds = host_tiers.chat_rounds(testing.ByteTokenizer(), seed=FLAGS.seed,
                                    conversations=FLAGS.host_tier_conversations,
                                    turns=FLAGS.host_tier_turns, answer_len=16)
    config = host_tiers.tier_config(model, rounds, FLAGS.page_size)
    result = dict(model=model.config.name, conversations=FLAGS.host_tier_conversations,
                  turns=FLAGS.host_tier_turns, device_pages=config["num_pages"])
    for mode in ("sync", "async"):
        result[mode] = host_tiers.host_tier_steps(model, rounds, config,
                                                  is_async=mode == "async")
    result["identical_tokens"] = result["sync"].pop("tokens") == result["async"].pop("tokens")
    return result


def _host_tokenizer(model: kvjax.Model):
    return model.tokenizer if model.tokenizer is not None else testing.ByteTokenizer()


def format_tables(results: dict) -> str:
    lines = []
    memory = results.get("memory")
    if memory:
        lines += ["| layout | KV util at peak load | time-weighted util | max running seqs "
                  "| mean running | preemptions | steps | tok/s |", "|" + "---|" * 8]
        for name in ("paged", "contiguous"):
            r = memory[name]
            lines.append(f"| {name} | {100 * r['utilization']['at_peak_load']:.1f}% | "
                         f"{100 * r['utilization']['time_weighted_mean']:.1f}% | "
                         f"{r['max_running']} | {r['mean_running']:.1f} | {r['preemptions']} | "
                         f"{r['steps']} | {r['tokens_per_s']:.1f} |")
        lines.append("")
    prefix = results.get("prefix")
    if prefix:
        lines += ["| prefix cache | hit rate | TTFT mean s | TTFT p50 s | TTFT p99 s |",
                  "|" + "---|" * 5]
        for name in ("cache_off", "cache_on"):
            r = prefix[name]
            lines.append(f"| {name.split('_')[1]} | {100 * r['prefix_hit_rate']:.1f}% | "
                         f"{r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
                         f"{r['ttft_p99_s']:.3f} |")
        lines.append("")
    host = results.get("host")
    if host:
        lines += [f"host, {host['model']}, batch {host['batch']} (median of "
                  f"{host['repeats']}; identical tokens: {host['identical_tokens']})",
                  "| scheduling | host ms/step | device wait ms/step | wall ms/step "
                  "| host fraction |", "|---|---|---|---|---|"]
        for mode in ("sync", "async"):
            r = host[mode]
            lines.append(f"| {mode} | {r['host_ms_per_step']:.2f} | "
                         f"{r['device_wait_ms_per_step']:.2f} | {r['wall_ms_per_step']:.2f} | "
                         f"{100 * r['host_fraction_of_wall']:.1f}% |")
        lines.append(f"wall saved per step: {host['wall_saved_ms_per_step']:.2f} ms = "
                     f"{100 * host['host_hidden_fraction']:.0f}% of the sync host time")
    tiers = (host or {}).get("tiers")
    if tiers:
        lines += ["", f"host tier, {tiers['model']}, {tiers['conversations']} conversations x "
                  f"{tiers['turns']} turns, {tiers['device_pages']} device pages (identical "
                  f"tokens: {tiers['identical_tokens']})",
                  "| scheduling | host ms/step | wall ms/step | host fraction | steps "
                  "| step calls measured | tier-hit tokens | prefill tokens |", "|" + "---|" * 8]
        for mode in ("sync", "async"):
            r = tiers[mode]
            lines.append(f"| {mode} | {r['host_ms_per_step']:.2f} | {r['wall_ms_per_step']:.2f} "
                         f"| {100 * r['host_fraction_of_wall']:.1f}% | {r['steps']} | "
                         f"{r['measured_steps']} | {r['tier_hit_tokens']} | "
                         f"{r['prefill_tokens']} |")
    return "\n".join(lines)


def main(argv):
    del argv
    # The two part 2 engines compile the same programs; the second reads them from disk.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="kvjax-bench-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    env = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               cpu_count=os.cpu_count(), machine=platform.machine(), jax=jax.__version__,
               backend=jax.default_backend(), load_average_start=list(os.getloadavg()))
    model = kvjax.load_model()
    parts = dict(memory=part_memory, prefix=part_prefix, host=part_host)
    unknown = sorted(set(FLAGS.parts) - set(parts))
    if unknown:
        raise app.UsageError(f"unknown --parts {unknown}; choose from {sorted(parts)}")
    results, timings = {}, {}
    for name in FLAGS.parts:
        start = time.perf_counter()
        results[name] = parts[name](model)
        timings[name] = time.perf_counter() - start
    env["load_average_end"] = list(os.getloadavg())
    env["part_seconds"] = timings
    print(format_tables(results))
    if FLAGS.output_json:
        flag_values = {name: FLAGS[name].value for name in (
            "parts", "max_model_len", "page_size", "budget_seqs", "max_num_seqs",
            "memory_requests", "prompt_median", "output_median", "prefix_requests",
            "prefix_rate", "prefix_len", "prefix_output_len", "host_batch", "host_new_tokens",
            "host_model", "host_repeats", "host_tiers", "host_tier_conversations",
            "host_tier_turns", "seed")}
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags=flag_values, env=env, results=results), f, indent=1)


if __name__ == "__main__":
    app.run(main)
