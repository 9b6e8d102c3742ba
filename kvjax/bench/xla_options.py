"""XLA's own CPU options against the native matmul kernel, on bench_decode's settings.

XLA_FLAGS are read once per process, so each option set runs in a process of its own
(`run` starts them, round after round, options alternating so that each sees the same
stretch of background load); inside one, the engine with XLA's matmuls (`MatmulImpl.XLA`)
and the one with the native kernel (`MatmulImpl.NATIVE`) take turns step by step
(`decode.timed_engine_runs`). Reported: the median full-batch decode step at each
(batch, prompt) setting and the median prefill of one prompt, per option set and matmul,
and each option set's XLA time over the native kernel's from the same process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

import kvjax
from kvjax.bench import decode
from kvjax.engine.step import MatmulImpl

# Option sets by name: the XLA_FLAGS each process runs with. This jaxlib (0.10.2) hands a
# float32 dot to YNNPACK by default (a `ynn_fusion` in the compiled HLO); with YNNPACK's fusion
# types emptied XLA emits its own dot, and oneDNN takes the dots only when it is both enabled
# and given them as a fusion type (`--xla_cpu_use_onednn` or `--xla_cpu_use_xnnpack` alone
# left the compiled HLO of the decoder's dots unchanged).
OPTIONS = {
    "default (YNNPACK dots)": "",
    "XLA's own dots": "--xla_cpu_experimental_ynn_fusion_type=",
    "oneDNN dots": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true "
                   "--xla_cpu_experimental_onednn_fusion_type=dot",
}
IMPLS = (MatmulImpl.XLA, MatmulImpl.NATIVE)


def _engine(model: kvjax.Model, impl: MatmulImpl, *, batch: int, max_len: int, chunk: int
            ) -> kvjax.Engine:
    return kvjax.Engine(model, kvjax.EngineConfig(
        matmul_impl=impl, max_num_seqs=batch, max_model_len=max_len, page_size=16,
        max_num_batched_tokens=chunk, max_prefill_chunk=chunk, enable_prefix_cache=False))


def measure(model: kvjax.Model, *, settings: Sequence[tuple[int, int]], new_tokens: int,
            prefill_len: int, repeats: int, seed: int) -> dict:
    """In this process (its XLA_FLAGS): {setting key: {impl: median seconds}}; decode
    settings are "B=..,ctx=..", the prefill "prefill=..". Tokens must agree across impls."""
    out: dict[str, dict[str, float]] = {}
    for batch, prompt_len in settings:
        prompts = decode.make_prompts(model, batch, prompt_len, seed)
        engines = {impl.value: _engine(model, impl, batch=batch, chunk=512,
                                       max_len=prompt_len + new_tokens + 8) for impl in IMPLS}
        for engine in engines.values():
            engine.generate([p[:64] for p in prompts], kvjax.SamplingParams(
                max_new_tokens=8, ignore_eos=True))
        runs = decode.timed_engine_runs(engines, prompts, new_tokens, profile=False)
        out[f"B={batch},ctx={prompt_len}"] = {
            name: float(np.median([r.wall_s for r in run.records if r.num_decode == batch
                                   and r.num_prefill == 0 and not r.compiled]))
            for name, run in runs.items()}
    prompt = decode.make_prompts(model, 1, prefill_len, seed)[0]
    engines = {impl.value: _engine(model, impl, batch=1, chunk=prefill_len,
                                   max_len=prefill_len + 8) for impl in IMPLS}
    times: dict[str, list[float]] = {name: [] for name in engines}
    sampling = kvjax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i in range(repeats + 1):  # the first (compiling) round untimed
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate([prompt], sampling)
            if i:
                times[name].append(time.perf_counter() - start)
    out[f"prefill={prefill_len}"] = {name: float(np.median(t)) for name, t in times.items()}
    return out


def run(command: Sequence[str], *, options: Sequence[str], rounds: int) -> dict:
    """Runs `command` (a child printing `measure`'s JSON as its last line) once per option
    set per round, alternating; returns {option: {setting: {impl: best median}}}, or
    {option: {"failed": why}} for an option set whose process died."""
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for option in options:
            env = dict(os.environ, XLA_FLAGS=OPTIONS[option])
            proc = subprocess.run(list(command), env=env, capture_output=True, text=True)
            if proc.returncode:
                why = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                       else f"exit status {proc.returncode}")
                best[option] = {"failed": f"the process died ({why})"}
                print(f"{option}: {best[option]['failed']}", file=sys.stderr, flush=True)
                continue
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            for key, by_impl in result.items():
                slot = best.setdefault(option, {}).setdefault(key, {})
                for impl, seconds in by_impl.items():
                    slot[impl] = min(seconds, slot.get(impl, float("inf")))
            print(f"{option}: {result}", file=sys.stderr, flush=True)
    return best


def format_table(best: dict) -> str:
    """Milliseconds per decode step / prefill, and XLA over native within each option set."""
    lines = ["| XLA option set | setting | XLA matmul ms | native matmul ms | XLA / native |",
             "|---|---|---:|---:|---:|"]
    for option, by_key in best.items():
        if "failed" in by_key:
            lines.append(f"| {option} | - | {by_key['failed']} | - | - |")
            continue
        for key, times in by_key.items():
            xla, native = times["xla"] * 1e3, times["native"] * 1e3
            lines.append(f"| {option} | {key} | {xla:.1f} | {native:.1f} | {xla / native:.2f} |")
    return "\n".join(lines)
