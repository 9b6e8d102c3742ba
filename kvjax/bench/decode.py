"""Decode throughput of kvjax (paged and contiguous KV) against Hugging Face transformers.

What `scripts/bench_decode.py` runs; `run` is the whole benchmark. Every system decodes the
same real-text prompts (corpus text through the model's tokenizer, all `prompt_len` tokens
long) greedily with the same weights for exactly `new_tokens` tokens. Only decode is timed,
after compilation:

  * kvjax: a first, shorter untimed run compiles every step shape the timed run needs; the
    timed run is driven step by step and only steps that decode all B sequences and nothing
    else (no prefill, no compilation) are kept. Their wall time includes the engine's host work.
    The paged and contiguous engines take turns, one step each, so that both see the same
    background load (this machine is shared).
  * transformers: `generate` with a logits processor that records when each step's logits are
    ready; the gaps between consecutive calls are the decode steps (prefill is the first call).
    It runs once before and once after the kvjax engines; the steps of both runs are pooled.

The floor of a step is max(bytes read / bandwidth, FLOPs / matmul rate), both rates measured on
this machine (`kvjax.bench.roofline`) at the start and right before and after each setting's
kvjax engines; the floor uses the best of all those measurements (`best_rates`, `add_floors`),
and `step_over_setting_floor` the better of the two taken around the result's own setting
(the memory of a shared machine is slower at some moments than at others). With `profile`,
a few full-batch decode steps of each kvjax run are traced with jax.profiler and their XLA
op time is split by kind (matmul, KV write, copies, the per-layer weight slices of the layer
scan, the attention loop; `classify_hlo_ops`); those steps are left out of the timing.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import math
import os
import platform
import re
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

import kvjax
from kvjax import cpu_kernels
from kvjax.bench import roofline
from kvjax.bench.workloads import poisson
from kvjax.engine.step import StepInput, StepShape, empty_step_input, model_step
from kvjax.models.loading import embedded_model_path

# Full-batch decode steps traced per engine with profile=True.
PROFILE_STEPS = 5


@dataclasses.dataclass
class StepRecord:
    """One engine step of a timed run."""

    wall_s: float  # engine.step() as the caller sees it
    device_s: float  # dispatch to tokens on the host
    host_s: float  # scheduling, input building, committing
    num_decode: int
    num_prefill: int
    compiled: bool
    kv_tokens: int  # tokens in the cache that the step's attention reads


def make_prompts(model: kvjax.Model, num: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`num` different corpus-text prompts of exactly `prompt_len` tokens (BOS first)."""
    requests = poisson(model.tokenizer, seed=seed, num_requests=num, rate=math.inf,
                       prompt_dist="fixed", prompt_len=prompt_len, prompt_min=1,
                       prompt_max=prompt_len, output_dist="fixed", output_len=1,
                       output_min=1, output_max=1)
    return [list(r.prompt_ids) for r in sorted(requests, key=lambda r: r.request_id)]


def summarize(values: list[float]) -> dict:
    """Median, mean, p90, min and count of `values`."""
    a = np.asarray(values, np.float64)
    return dict(median=float(np.median(a)), mean=float(a.mean()), p90=float(np.percentile(a, 90)),
                min=float(a.min()), n=int(a.size))


@dataclasses.dataclass
class TimedRun:
    """The timed run of one engine.

    Attributes:
      engine: the engine, its requests already added.
      trace_dir: where traced steps write jax.profiler traces (None: no tracing).
      records: one per engine step.
      outputs: request id -> generated token ids.
      traced: indices (into records) of the steps that ran under the profiler.
    """

    engine: kvjax.Engine
    trace_dir: str | None
    records: list[StepRecord] = dataclasses.field(default_factory=list)
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    traced: list[int] = dataclasses.field(default_factory=list)

    def step(self, batch: int) -> None:
        """One engine step, recorded; traced if it is among the first full-batch ones after 4."""
        engine = self.engine
        num_full = sum(r.num_decode == batch and r.num_prefill == 0 for r in self.records)
        tracing = (self.trace_dir is not None and num_full >= 4
                   and len(self.traced) < PROFILE_STEPS)
        if tracing:
            jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True)
        before, compiles = dict(engine.stats), engine.num_compiles
        per_token = engine.kv_bytes_per_token
        live_before = engine.kv_samples[-1][1] // per_token if engine.kv_samples else 0
        start = time.perf_counter()
        finished = engine.step()
        wall = time.perf_counter() - start
        if tracing:
            jax.profiler.stop_trace()
            self.traced.append(len(self.records))
        stats = engine.stats
        num_decode = stats["decode_tokens"] - before["decode_tokens"]
        self.records.append(StepRecord(
            wall_s=wall, device_s=stats["step_time_s"] - before["step_time_s"],
            host_s=stats["host_time_s"] - before["host_time_s"], num_decode=num_decode,
            num_prefill=stats["prefill_tokens"] - before["prefill_tokens"],
            compiled=engine.num_compiles != compiles, kv_tokens=int(live_before) + num_decode))
        self.outputs.update({o.request_id: o.outputs[0].token_ids for o in finished})


def timed_engine_runs(engines: dict[str, kvjax.Engine], prompts: list[list[int]],
                      new_tokens: int, *, profile: bool) -> dict[str, TimedRun]:
    """Runs the prompts to completion on every engine, one step of each engine in turn.

    Interleaving the engines' steps exposes them to the same background load; on a shared
    machine that load varies more, minute to minute, than the engines differ.
    """
    sampling = kvjax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    runs = {}
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"timed-{i}", prompt, sampling)
        runs[name] = TimedRun(engine, tempfile.mkdtemp(prefix=f"kvjax-trace-{name}-")
                              if profile else None)
    while any(run.engine.has_unfinished() for run in runs.values()):
        for run in runs.values():
            if run.engine.has_unfinished():
                run.step(len(prompts))
    return runs


def classify_hlo_ops(hlo_text: str) -> dict[str, str]:
    """Instruction name -> '<where>: <kind>' for every instruction of a compiled HLO module.

    <where> is the while-loop nesting: outside the layer loop, in the layer loop (the scan over
    layers), or in the attention loop (the blockwise loop inside each layer). <kind> comes from
    the opcode, or for a fusion from the ops fused into it.
    """
    computations: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) ", line)
        if header and line.rstrip().endswith("{"):
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif current is not None and line.strip().startswith(("%", "ROOT")):
            current.append(line.strip())
    where_names = ("outside the layer loop", "layer loop", "attention loop")
    ops: dict[str, str] = {}

    def walk(computation: str, depth: int) -> None:
        for line in computations.get(computation, []):
            body = re.search(r"body=%([\w.\-]+)", line)
            if body:
                walk(body.group(1), depth + 1)
                continue
            match = re.match(r"(?:ROOT )?%([\w.\-]+) = (?:\([^=]*\)|\S+) ([\w\-]+)\(", line)
            if not match:
                continue
            called = re.search(r"calls=%([\w.\-]+)", line)
            fused = " ".join(computations.get(called.group(1), [])) if called else ""
            opcode = match.group(2)
            if opcode == "dot" or " dot(" in fused:
                kind = "matmul"
            elif opcode in ("scatter", "dynamic-update-slice") or "scatter(" in fused or \
                    "dynamic-update-slice(" in fused:
                kind = "KV write"
            elif opcode == "gather" or "gather(" in fused:
                kind = "gather"
            elif opcode == "dynamic-slice" or "dynamic-slice(" in fused:
                kind = "dynamic-slice"
            elif opcode == "copy" or " copy(" in fused:
                kind = "copy"
            else:
                kind = "other"
            ops[match.group(1)] = f"{where_names[min(depth, 2)]}: {kind}"

    walk(entry, 0)
    return ops


def profile_breakdown(engine: kvjax.Engine, batch: int, trace_dir: str, num_steps: int) -> dict:
    """Device time per step of each kind of XLA op in the traced full-batch decode steps.

    Op times are summed over XLA's thunk executor, which runs independent ops concurrently, so
    their sum can exceed the step's wall time; the shares are what to read.
    """
    shape = StepShape(num_decode=batch, num_prefill=0, chunk=1,
                      max_pages=engine.block_table_width)
    # The same jit the engine's runner builds, so the compiled module has the same op names.
    step = jax.jit(functools.partial(model_step, config=engine.model.config,
                                     attention_impl=engine.config.attention_impl,
                                     matmul_impl=engine.config.matmul_impl),
                   static_argnames=("shape",), donate_argnames=("kv",))
    ops = classify_hlo_ops(step.lower(engine.model.params, engine.kv,
                              StepInput(**empty_step_input(shape)), shape=shape)
                   .compile().as_text())
    events = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):
        with gzip.open(path) as f:
            events += json.load(f)["traceEvents"]
    per_kind: collections.Counter = collections.Counter()
    per_op: collections.Counter = collections.Counter()
    unmatched = 0.0
    for event in events:
        args = event.get("args", {})
        if event.get("ph") != "X" or args.get("hlo_module") != "jit_model_step":
            continue
        ms = event["dur"] / 1e3 / num_steps
        if event["name"] in ops:
            per_kind[ops[event["name"]]] += ms
            per_op[event["name"]] += ms
        elif "while" not in event["name"]:  # loops are containers of the ops counted above
            unmatched += ms
    total = sum(per_kind.values())
    return dict(op_ms_per_step=total, unmatched_ms_per_step=unmatched,
                by_kind={k: dict(ms=v, share=v / total) for k, v in per_kind.most_common()},
                top_ops={k: v for k, v in per_op.most_common(10)})


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kvjax engine of the benchmark: a KV layout and, for pages, a KV codec; or the
    paged exact engine with `EngineConfig.batch_invariant`."""

    layout: kvjax.KVLayout = kvjax.KVLayout.PAGED
    codec: str = "none"
    batch_invariant: bool = False

    @property
    def name(self) -> str:
        return (self.layout.value + ("" if self.codec == "none" else f"-{self.codec}")
                + ("-invariant" if self.batch_invariant else ""))


def parse_variants(layouts: Sequence[str], codecs: Sequence[str],
                   batch_invariant: bool = False) -> list[Variant]:
    """Each layout with exact KV, then the paged layout with every other codec, then (with
    `batch_invariant`) the paged exact engine in batch-invariant mode."""
    variants = [Variant(kvjax.KVLayout(name)) for name in layouts]
    variants += [Variant(kvjax.KVLayout.PAGED, c) for c in codecs if c != "none"]
    return variants + ([Variant(batch_invariant=True)] if batch_invariant else [])


def bench_kvjax(model: kvjax.Model, variants: Sequence[Variant], prompts: list[list[int]],
                new_tokens: int, *, page_size: int, warm_tokens: int, profile: bool = False
                ) -> tuple[list[dict], dict[str, list[list[int]]]]:
    """Decode step times of one engine per variant at batch len(prompts), run side by side.

    Each engine first runs `warm_tokens` (at most `new_tokens`) untimed new tokens from
    prompts of at most 64 tokens, which compiles every decode shape the timed run needs (the
    block-table width is the engine's, whatever the prompt). With `profile`, the first few
    full-batch decode steps are traced (`profile_breakdown`) and left out of the timing.

    Chunked prefill spreads the B prompts over ceil(B * prompt_len / max_num_batched_tokens)
    steps, in which the first rows already decode; the timed run generates that many tokens
    more than `new_tokens` so that about `new_tokens` steps decode the whole batch, and the
    outputs are cut to `new_tokens` (the tokens compared with transformers').

    Returns (one result per variant, output ids per variant).
    """
    batch = len(prompts)
    prefill_steps = -(-batch * len(prompts[0]) // kvjax.EngineConfig().max_num_batched_tokens)
    timed_tokens = new_tokens + prefill_steps
    engines, compile_s = {}, {}
    for variant in variants:
        options = {"group": 32} if variant.codec in ("int4", "int2") else {}
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            kv_layout=variant.layout, kv_codec=variant.codec, kv_codec_options=options,
            page_size=page_size, max_num_seqs=batch,
            max_model_len=len(prompts[0]) + timed_tokens, enable_prefix_cache=False,
            batch_invariant=variant.batch_invariant))
        start = time.perf_counter()
        engine.generate([p[:64] for p in prompts], kvjax.SamplingParams(
            max_new_tokens=min(warm_tokens, new_tokens), ignore_eos=True))
        compile_s[variant.name] = time.perf_counter() - start
        engines[variant.name] = engine
    runs = timed_engine_runs(engines, prompts, timed_tokens, profile=profile)
    results = [_kvjax_result(name, run, batch, compile_s[name])
               for name, run in runs.items()]
    for result in results:
        result.update(prompt_len=len(prompts[0]), generated_tokens=timed_tokens)
    ids = [f"timed-{i}" for i in range(batch)]
    return results, {name: [run.outputs[r][:new_tokens] for r in ids]
                     for name, run in runs.items()}


def _kvjax_result(name: str, run: TimedRun, batch: int, compile_s: float) -> dict:
    engine, records = run.engine, run.records
    decode = [r for i, r in enumerate(records) if r.num_decode == batch and r.num_prefill == 0
              and not r.compiled and i not in run.traced]
    if not decode:
        raise ValueError(f"no full-batch decode step at batch {batch}: raise new_tokens")
    costs = np.array([roofline.decode_step_cost(engine.model.config, engine.model.params, batch,
                                                r.kv_tokens, engine.kv_bytes_per_token)
                      for r in decode])
    wall = summarize([r.wall_s for r in decode])
    result = dict(
        system=f"kvjax-{name}", batch=batch, tokens_per_s=batch / wall["median"],
        step_s=wall, device_s=summarize([r.device_s for r in decode]),
        host_s=summarize([r.host_s for r in decode]),
        host_fraction=sum(r.host_s for r in decode) / sum(r.wall_s for r in decode),
        bytes_per_step=float(costs[:, 0].mean()), flops_per_step=float(costs[:, 1].mean()),
        mean_kv_tokens=float(np.mean([r.kv_tokens for r in decode])),
        kv_bytes_per_step=float(np.mean([r.kv_tokens for r in decode])
                                * engine.kv_bytes_per_token),
        kv_codec=engine.kv.codec_name, attention=engine.attention_name,
        kv_pool_bytes=int(engine.kv.nbytes()), compile_run_s=compile_s,
        num_steps=len(records), num_compiles=engine.num_compiles)
    if run.traced:
        full = all(records[i].num_decode == batch and records[i].num_prefill == 0
                   for i in run.traced)
        result["profile"] = (profile_breakdown(engine, batch, run.trace_dir, len(run.traced))
                             if full else "traced steps were not all full-batch decode steps")
        result["profile_wall_s"] = float(np.median([records[i].wall_s for i in run.traced]))
    return result


def load_hf_model():
    """transformers' own load of the embedded GGUF file, float32, eval mode."""
    import torch
    import transformers

    path = embedded_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def bench_hf(hf_model, prompts: list[list[int]], new_tokens: int, threads: int
             ) -> tuple[dict, list[list[int]]]:
    """Decode step times of transformers `generate` (greedy, exactly new_tokens tokens)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    stamps: list[float] = []

    class StepClock(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    input_ids = torch.tensor(prompts, dtype=torch.long)

    def run(num_tokens: int):
        generation = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            eos_token_id=hf_model.generation_config.eos_token_id,
            pad_token_id=hf_model.generation_config.pad_token_id)
        with torch.no_grad():
            return hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                     generation_config=generation,
                                     logits_processor=transformers.LogitsProcessorList(
                                         [StepClock()]))

    run(2)
    stamps.clear()
    start = time.perf_counter()
    out = run(new_tokens)
    total_s = time.perf_counter() - start
    result = dict(system=f"transformers-{threads}t", batch=len(prompts),
                  step_times_s=[float(t) for t in np.diff(stamps)], timed_run_s=total_s,
                  prefill_s=stamps[0] - start, torch_threads=torch.get_num_threads(),
                  transformers=transformers.__version__, torch=torch.__version__)
    return result, out[:, input_ids.shape[1]:].tolist()


def merge_hf_runs(runs: list[dict]) -> dict:
    """One result from repeated runs of the same configuration: their decode steps pooled."""
    steps = [t for run in runs for t in run["step_times_s"]]
    merged = {k: v for k, v in runs[0].items() if k not in ("step_times_s", "timed_run_s",
                                                           "prefill_s")}
    merged["step_s"] = summarize(steps)
    merged["tokens_per_s"] = merged["batch"] / merged["step_s"]["median"]
    merged["runs"] = [dict(step_median_s=float(np.median(run["step_times_s"])),
                           timed_run_s=run["timed_run_s"], prefill_s=run["prefill_s"])
                      for run in runs]
    return merged


def token_agreement(reference: list[list[int]], test: list[list[int]], eos: tuple[int, ...]
                    ) -> float:
    """Mean fraction of each reference sequence reproduced before the first difference.

    Sequences are compared up to the first EOS in either: there transformers suppresses EOS
    (min_new_tokens) while kvjax keeps it (ignore_eos), so the two continue from different
    tokens by design.
    """
    fractions = []
    for ref, out in zip(reference, test, strict=True):
        stop = min(next((i for i, t in enumerate(seq) if t in eos), len(seq))
                   for seq in (ref, out))
        same = next((i for i, (a, b) in enumerate(zip(ref[:stop], out, strict=False))
                     if a != b), stop)
        fractions.append(same / max(stop, 1))
    return float(np.mean(fractions))


def environment() -> dict:
    """The date, machine, load average, jax version and backend a run is reported with."""
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=platform.machine(), cpu=cpu_kernels.cpu_model(), cpu_count=os.cpu_count(),
        load_average_start=list(os.getloadavg()), jax=jax.__version__,
        backend=jax.default_backend(), python=platform.python_version())


def format_table(results: list[dict]) -> str:
    """The markdown table of decode results, one row per system and batch size."""
    header = ("| system | B | prompt | tok/s | step ms (median) | step ms (p90) | floor ms "
              "| step/floor | step/floor (setting's probes) | host ms/step | host % |")
    lines = [header, "|" + "---|" * 11]
    for r in results:
        floor, own = r.get("floor_s"), r.get("step_over_setting_floor")
        lines.append("| {} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {} | {} | {} | {} | {} |".format(
            r["system"], r["batch"], r["prompt_len"], r["tokens_per_s"],
            1e3 * r["step_s"]["median"],
            1e3 * r["step_s"]["p90"], f"{1e3 * floor:.1f}" if floor else "-",
            f"{r['step_over_floor']:.2f}" if floor else "-", f"{own:.2f}" if own else "-",
            f"{1e3 * r['host_s']['median']:.2f}" if "host_s" in r else "-",
            f"{100 * r['host_fraction']:.1f}" if "host_fraction" in r else "-"))
    return "\n".join(lines)


def format_profile(result: dict) -> str:
    """The op-time breakdown of a profiled result, one line per kind of op."""
    profile = result["profile"]
    if isinstance(profile, str):
        return f"  profile: {profile}"
    lines = [f"  profile of {result['system']} B={result['batch']}: "
             f"{profile['op_ms_per_step']:.1f} ms of XLA op time per step "
             f"(wall {1e3 * result['profile_wall_s']:.1f} ms)"]
    lines += [f"    {v['ms']:7.2f} ms {100 * v['share']:5.1f}%  {k}"
              for k, v in profile["by_kind"].items()]
    return "\n".join(lines)


def best_rates(rate_samples: Sequence[roofline.MachineRates]) -> roofline.MachineRates:
    """The best memory and matmul rate of several measurements.

    A floor must not rise because the machine was busy while a rate was measured.
    """
    return dataclasses.replace(
        rate_samples[0], memory_bytes_per_s=max(r.memory_bytes_per_s for r in rate_samples),
        matmul_flops_per_s=max(r.matmul_flops_per_s for r in rate_samples))


def add_floors(results: list[dict], rates: roofline.MachineRates) -> None:
    """Adds each kvjax result's roofline floor and its median step over that floor, in place.

    The floor uses `rates` (the best of the run); a result that carries `setting_rates` (the
    probes taken right before and after its own setting: on a shared machine the bandwidth
    of the moment differs from the run's best) also gets `setting_floor_s` and
    `step_over_setting_floor`. Results without `bytes_per_step` (transformers') are left as
    they are.
    """
    for result in results:
        if "bytes_per_step" not in result:
            continue
        floor = roofline.step_floor(result["bytes_per_step"], result["flops_per_step"], rates)
        result.update(floor_s=floor.floor_s, floor_memory_s=floor.memory_s,
                      floor_compute_s=floor.compute_s, floor_bound=floor.bound,
                      step_over_floor=result["step_s"]["median"] / floor.floor_s)
        if "setting_rates" in result:
            own = roofline.step_floor(result["bytes_per_step"], result["flops_per_step"],
                                      roofline.MachineRates(**result["setting_rates"]))
            result.update(setting_floor_s=own.floor_s,
                          step_over_setting_floor=result["step_s"]["median"] / own.floor_s)


def speedup_ratios(results: list[dict], batch: int, prompt_len: int) -> dict:
    """At one setting: paged vs contiguous step time, each kvjax system's speedup over the
    fastest transformers run, and each paged codec's speedup over exact paged KV (None where
    a system did not run)."""
    by_system = {r["system"]: r for r in results
                 if r["batch"] == batch and r["prompt_len"] == prompt_len}
    paged, contiguous = by_system.get("kvjax-paged"), by_system.get("kvjax-contiguous")
    hf = max((r for r in by_system.values() if r["system"].startswith("transformers")),
             key=lambda r: r["tokens_per_s"], default=None)
    ratios = dict(
        paged_over_contiguous_step=(paged["step_s"]["median"] / contiguous["step_s"]["median"]
                                    if paged and contiguous else None),
        fastest_hf=hf["system"] if hf else None)
    for name, r in by_system.items():
        if not name.startswith("kvjax-"):
            continue
        short = name.removeprefix("kvjax-").replace("-", "_")
        ratios[f"{short}_speedup_over_hf"] = (r["tokens_per_s"] / hf["tokens_per_s"]
                                              if hf else None)
        if paged and name.startswith("kvjax-paged-"):
            ratios[f"{short}_speedup_over_paged"] = (paged["step_s"]["median"]
                                                     / r["step_s"]["median"])
    return ratios


def run(model: kvjax.Model, *, settings: Sequence[tuple[int, int]], new_tokens: int,
        variants: Sequence[Variant], torch_threads: Sequence[int], skip_hf: bool,
        page_size: int, warm_tokens: int, seed: int, profile: bool) -> dict:
    """The whole benchmark, printing each result as it comes and the table at the end.

    settings: (batch size, prompt length) pairs, each run by every kvjax variant and by
    transformers (before and after the kvjax engines, so both see the load of the stretch).

    Returns a JSON-ready dict: env, rates (the best measured), rate_samples, results (one per
    system and setting), ratios and token_agreement_with_hf (per setting, keyed "B=8,ctx=64").
    """
    env = environment()
    rate_samples = [roofline.measure_machine()]
    hf_model = None if skip_hf else load_hf_model()
    results, agreement, ratios = [], {}, {}
    for batch, prompt_len in settings:
        key = f"B={batch},ctx={prompt_len}"
        prompts = make_prompts(model, batch, prompt_len, seed)
        hf_runs: dict[int, list[dict]] = collections.defaultdict(list)
        hf_outputs = {}
        for threads in ([] if hf_model is None else torch_threads):
            hf_run, hf_outputs[threads] = bench_hf(hf_model, prompts, new_tokens, threads)
            hf_runs[threads].append(hf_run)
        rate_samples.append(roofline.measure_machine())
        kvjax_results, outputs = bench_kvjax(model, variants, prompts, new_tokens,
                                             page_size=page_size, warm_tokens=warm_tokens,
                                             profile=profile)
        rate_samples.append(roofline.measure_machine())
        setting_rates = dataclasses.asdict(best_rates(rate_samples[-2:]))
        for result in kvjax_results:
            result["setting_rates"] = setting_rates
            results.append(result)
            print(format_table([result]).splitlines()[-1], flush=True)
            if "profile" in result:
                print(format_profile(result), flush=True)
        for threads, runs in hf_runs.items():
            runs.append(bench_hf(hf_model, prompts, new_tokens, threads)[0])
            result = merge_hf_runs(runs)
            result.update(prompt_len=prompt_len, kv_bytes_per_step=hf_kv_bytes(
                model.config, batch, prompt_len + new_tokens / 2))
            results.append(result)
            print(format_table([result]).splitlines()[-1], flush=True)
            agreement.setdefault(key, {})[result["system"]] = {
                name: token_agreement(hf_outputs[threads], out, model.config.eos_token_ids)
                for name, out in outputs.items()}
    env["load_average_end"] = list(os.getloadavg())
    rates = best_rates(rate_samples)
    print(f"best of {len(rate_samples)} measurements: memory "
          f"{rates.memory_bytes_per_s / 1e9:.1f} GB/s, matmul "
          f"{rates.matmul_flops_per_s / 1e9:.1f} GFLOP/s")
    add_floors(results, rates)
    print(format_table(results))
    for batch, prompt_len in settings:
        key = f"B={batch},ctx={prompt_len}"
        ratios[key] = speedup_ratios(results, batch, prompt_len)
        print(f"{key}: {ratios[key]}  token agreement with HF: {agreement.get(key)}")
    return dict(env=env, rates=dataclasses.asdict(rates),
                rate_samples=[dataclasses.asdict(r) for r in rate_samples], results=results,
                ratios=ratios, token_agreement_with_hf=agreement)


def hf_kv_bytes(config, batch: int, mean_len: float) -> float:
    """KV bytes transformers reads per decode step: float32 K and V of every cached token."""
    return batch * mean_len * config.kv_bytes_per_token("float32")


def plot_step_vs_kv_bytes(result: dict, path: str, batch: int) -> None:
    """Step time against KV bytes read per step at `batch`: one line per system over the
    prompt lengths, and the floor (weights + KV bytes over the measured bandwidth)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    rows = [r for r in result["results"] if r["batch"] == batch]
    for system in dict.fromkeys(r["system"] for r in rows):
        points = sorted((r["kv_bytes_per_step"], r["step_s"]["median"]) for r in rows
                        if r["system"] == system)
        xs, ys = zip(*points, strict=True)
        ax.plot(np.asarray(xs) / 1e6, np.asarray(ys) * 1e3, marker="o", label=system)
    weights = min((r["bytes_per_step"] - r["kv_bytes_per_step"] for r in rows
                   if "bytes_per_step" in r), default=0.0)
    top = max(r["kv_bytes_per_step"] for r in rows)
    xs = np.linspace(0, top, 50)
    ax.plot(xs / 1e6, (weights + xs) / result["rates"]["memory_bytes_per_s"] * 1e3, "k--",
            label="floor: (weights + KV bytes) / bandwidth")
    ax.set_xlabel("KV bytes read per decode step (MB)")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title(f"Decode step vs KV bytes, B={batch}, SmolLM2-135M float32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
