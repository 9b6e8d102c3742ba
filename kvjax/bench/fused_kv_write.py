"""The fused KV write against K/V materialized, then scattered: bytes and time, side by side.

Two measurements over the same model weights, each system timed alternately so a noisy machine
slows both alike:

  layers  every layer's K/V projection and write for T token rows, nothing else (a scan over
          the layers; the pool donated): `fused_write.write_projected` against the native
          matmul, XLA's RoPE and `KVState.write`. Bytes: the [T, K, D] K and V arrays the
          unfused program writes and the scatter reads back (per layer, from the shapes), and
          each compiled program's temporary buffers (XLA's memory analysis).
  engine  greedy generation of a batch through the whole engine, fused_kv_write on and off.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.kv import fused_write
from kvjax.kv.state import init_paged_kv
from kvjax.models import linear, llama


def layer_writes(config, params, x, positions, slots, kv, *, fused: bool):
    """Writes K/V of x [T, H] (every layer, as if each layer's normed input) into slots [T]."""
    layers = params["layers"]
    t = x.shape[0]

    def body(kv, layer):
        bk, bv = (layers["bk"][layer], layers["bv"][layer]) if config.qkv_bias else (None, None)
        if fused:
            return fused_write.write_projected(
                kv, layer, slots, x, layers["wk"], layers["wv"], layer, bk, bv,
                *llama.rope_tables(config, positions, layer)), None
        k = linear.native_linear(x, layers["wk"], layer)  # [T, K*D]
        v = linear.native_linear(x, layers["wv"], layer)
        if bk is not None:
            k, v = k + bk, v + bv
        shape = (t, config.num_kv_heads, config.head_dim)
        k = llama.apply_rope(config, k.reshape(shape), positions, layer)  # [T, K, D]
        return kv.write(layer, slots, k, v.reshape(shape)), None

    return jax.lax.scan(body, kv, jnp.arange(config.num_layers, dtype=jnp.int32))[0]


def _time(calls: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


def run_layers(model, tokens: list[int], repeats: int, num_pages: int = 256,
               page_size: int = 16) -> list[dict]:
    """One row per token count: ms per call and bytes, fused and unfused."""
    config, params = model.config, model.params
    rng = np.random.default_rng(0)
    rows = []
    for t in tokens:
        x = jnp.asarray(rng.normal(size=(t, config.hidden_size)), jnp.float32)
        positions = jnp.asarray(rng.integers(0, 2048, t), jnp.int32)
        slots = jnp.asarray(rng.permutation(num_pages * page_size)[:t], jnp.int32)
        programs, pools, temp = {}, {}, {}
        for name, fused in (("unfused", False), ("fused", True)):
            programs[name] = jax.jit(functools.partial(
                layer_writes, config, params, x, positions, slots, fused=fused),
                donate_argnums=0)
            pools[name] = init_paged_kv(config, num_pages, page_size)
            compiled = programs[name].lower(pools[name]).compile()
            temp[name] = int(compiled.memory_analysis().temp_size_in_bytes)

        def call(name, programs=programs, pools=pools):
            pools[name] = programs[name](pools[name])
            jax.block_until_ready(pools[name])

        for name in programs:
            call(name)
        ms = _time({name: (lambda name=name: call(name)) for name in programs}, repeats)
        kv_bytes = t * config.num_kv_heads * config.head_dim * 4  # one [T, K, D] f32 array
        rows.append(dict(
            tokens=t, ms=ms, fused_over_unfused=ms["fused"] / ms["unfused"],
            pool_bytes_written=2 * kv_bytes * config.num_layers,
            # K and V materialized (written) and read back by the scatter, every layer.
            materialized_bytes_saved=4 * kv_bytes * config.num_layers,
            temp_bytes=temp))
    return rows


def run_engine(model, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """ms per generated token of a greedy batch, fused_kv_write on and off (same tokens)."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, model.config.vocab_size, prompt_len)]
               for _ in range(batch)]
    sampling = kvjax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engines = {name: kvjax.Engine(model, kvjax.EngineConfig(
        max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 16,
        fused_kv_write=fused)) for name, fused in (("unfused", False), ("fused", True))}
    tokens = {name: [o.outputs[0].token_ids for o in e.generate(prompts, sampling)]
              for name, e in engines.items()}  # compiles every step shape
    ms = _time({name: (lambda e=e: e.generate(prompts, sampling)) for name, e in
                engines.items()}, repeats)
    per_token = {name: v / (batch * new_tokens) for name, v in ms.items()}
    return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                ms_per_token=per_token, fused_over_unfused=ms["fused"] / ms["unfused"],
                same_tokens=tokens["fused"] == tokens["unfused"])


@dataclasses.dataclass(frozen=True)
class Result:
    model: str
    layers: list[dict]
    engine: dict


def run(tokens: list[int], repeats: int, batch: int, prompt_len: int, new_tokens: int
        ) -> Result:
    """Both measurements on the embedded model (float32)."""
    reason = linear.kv_write_unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    model = kvjax.load_model()
    return Result(model=model.config.name, layers=run_layers(model, tokens, repeats),
                  engine=run_engine(model, batch, prompt_len, new_tokens, repeats))


def table(result: Result) -> str:
    """Markdown tables of `result`."""
    lines = ["| tokens | unfused ms | fused ms | fused / unfused | K/V bytes materialized "
             "(saved) | temp bytes unfused | temp bytes fused |", "|---" * 7 + "|"]
    for r in result.layers:
        lines.append(f"| {r['tokens']} | {r['ms']['unfused']:.2f} | {r['ms']['fused']:.2f} | "
                     f"{r['fused_over_unfused']:.2f} | {r['materialized_bytes_saved']:,} | "
                     f"{r['temp_bytes']['unfused']:,} | {r['temp_bytes']['fused']:,} |")
    e = result.engine
    lines += ["", "| engine (batch, prompt, new) | unfused ms/token | fused ms/token | "
              "fused / unfused | same tokens |", "|---" * 5 + "|",
              f"| {e['batch']}, {e['prompt_len']}, {e['new_tokens']} | "
              f"{e['ms_per_token']['unfused']:.2f} | {e['ms_per_token']['fused']:.2f} | "
              f"{e['fused_over_unfused']:.2f} | {e['same_tokens']} |"]
    return "\n".join(lines)


def write(result: Result, path: str) -> None:
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(result), f, indent=1)


def compiled_bytes_table(records: list[dict]) -> str:
    """A markdown table of the engine step compiled for GPUs/TPUs with and without the Pallas
    fused write (`kvjax.bench.deviceless` records of its qk_norm step programs): XLA's
    temporary bytes and the cost analysis' bytes accessed, unfused (`step_*_qk`) beside
    fused (`step_*_fused`)."""
    by_id = {(r["program"], r["target"], r["dtype"], r["shape"]): r for r in records}
    lines = ["| step | target | dtype | shape | temp bytes unfused | temp bytes fused | "
             "bytes accessed unfused | bytes accessed fused |", "|---" * 8 + "|"]
    for (program, target, dtype, shape), fused in by_id.items():
        if not program.endswith("_fused"):
            continue
        unfused = by_id.get((program.replace("_fused", "_qk"), target, dtype, shape))
        if unfused is None or "compiled" not in (fused["status"], unfused["status"]):
            continue
        cells = []
        for key, part in (("temp_size_in_bytes", "memory"), ("bytes accessed", "cost")):
            for r in (unfused, fused):
                value = r.get(part, {}).get(key)
                cells.append("n/a" if value is None else f"{int(value):,}")
        lines.append(f"| {program.removesuffix('_fused')} | {target} | {dtype} | {shape} | "
                     + " | ".join([cells[0], cells[1], cells[2], cells[3]]) + " |")
    return "\n".join(lines)
