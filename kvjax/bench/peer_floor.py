"""The floor of a vLLM peer workload (`kvjax.bench.vllm_peer`): what the whole run's FLOPs take
at this machine's measured matmul rate, or its weight reads at the measured memory bandwidth,
whichever is longer, and so the most output tokens/s any server could reach on it.

    rates = measure_matmul_rates(("float32",))
    floors = floor_rows(kvjax.load_model().config, PeerConfig(), rates, ("random",),
                        bytes_per_s=roofline.measure_memory_bandwidth())
    print(floor_table(floors))

The run's FLOPs (`run_flops`): every request's prefill and decode steps, projections, MLP,
output head and attention (`prefill.prefill_flops`, `roofline.decode_step_flops`), from the
model config and the workload's prompt, output and shared-prefix lengths. A shared prefix is
counted once, as an ideal prefix cache computes it: the first request prefills its whole prompt,
every other one only the tokens after the prefix (reading the prefix's K/V). The rate is
`roofline.measure_matmul_rate` in the served dtype (operands of that dtype summed in float32,
as the model's matmuls are), the probe `bench_decode`'s floors use.

The bytes term (`min_steps`, `weight_bytes_per_step`): each request's output tokens come from
`output_len` forward passes one after another (no speculative decoding), and a step serves at
most min(max_num_seqs, max_concurrency) requests, so the run takes at least
ceil(num_prompts * output_len / that) steps; each step reads every matmul weight once (the
weights are far larger than the caches). The run cannot be faster than those reads at
`roofline.measure_memory_bandwidth`, whatever the steps' FLOPs: a valid floor beside the FLOPs'
(one weight read per step may carry any share of the FLOPs, so the two do not add).

Per dtype and workload (`add_floors`): `run_flops`, `matmul_flops_per_s`, `flops_floor_s` (the
FLOPs over the rate), `min_steps`, `weight_bytes_per_step`, `memory_bytes_per_s` and
`bytes_floor_s` (None without a bandwidth), `floor_s` (the longer of the two), `bound`
('flops' or 'bytes'), `floor_output_throughput` (the run's output tokens over `floor_s`); each
server's `achieved_flops_per_s` (the run's FLOPs over its run time: output tokens over its
output tokens/s); and `target_over_floor`, `TARGET_SPEEDUP` x vLLM's output tokens/s over the
floor throughput: above 1, the target asks for more than the matmuls can do at the measured
rate. The floor leaves out the K/V bytes and all work besides matmuls and attention, so it is
below what any server can reach. A Poisson workload is bound by its arrival rate instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from kvjax.bench import roofline
from kvjax.bench.prefill import prefill_flops
from kvjax.bench.vllm_peer import SERVERS, WORKLOADS, PeerConfig

# The throughput target of the peer comparison: kvjax's output tokens/s over vLLM's.
TARGET_SPEEDUP = 1.2


def shared_prefix_len(workload: str) -> int:
    """Tokens of the prefix every prompt of `workload` shares (its --random-prefix-len; 0)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {sorted(WORKLOADS)}")
    args = WORKLOADS[workload]
    flag = "--random-prefix-len"
    return int(args[args.index(flag) + 1]) if flag in args else 0


def run_flops(config, *, num_prompts: int, prefix_len: int, input_len: int,
              output_len: int) -> float:
    """FLOPs of serving `num_prompts` requests of `prefix_len` shared + `input_len` own prompt
    tokens and `output_len` output tokens each: one prefill of a whole prompt, the others'
    prefills after the shared prefix, and every request's `output_len - 1` decode steps (the
    prefill gives the first output token)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"need num_prompts, input_len, output_len >= 1 and prefix_len >= 0, "
                         f"got {num_prompts}, {input_len}, {output_len}, {prefix_len}")
    prompt = prefix_len + input_len
    decode = sum(roofline.decode_step_flops(config, 1, prompt + k) for k in range(1, output_len))
    return (prefill_flops(config, prompt)
            + (num_prompts - 1) * prefill_flops(config, prompt, num_cached=prefix_len)
            + num_prompts * decode)


def measure_matmul_rates(dtypes: Sequence[str], *, matmul_size: int = 1024,
                         repeats: int = 5) -> dict[str, float]:
    """FLOP/s of the matmul probe (`roofline.measure_matmul_rate`) in each dtype."""
    return {d: roofline.measure_matmul_rate(matmul_size, repeats=repeats, dtype=d)
            for d in dtypes}


def min_steps(peer: PeerConfig) -> int:
    """Fewest forward passes that serve `peer`'s workload: every request's `output_len` tokens
    one pass each, at most min(max_num_seqs, max_concurrency) requests per pass."""
    per_step = min(peer.max_num_seqs, peer.max_concurrency)
    return -(-peer.num_prompts * peer.output_len // per_step)


def floor_rows(config, peer: PeerConfig, rates: Mapping[str, float],
               workloads: Sequence[str] = tuple(WORKLOADS), *,
               bytes_per_s: float | None = None) -> list[dict[str, Any]]:
    """One row per dtype of `rates` and workload: dtype, workload and its `floor` (the keys
    of the module docstring), without servers; no bytes term without `bytes_per_s`."""
    rows = []
    steps = min_steps(peer)
    for dtype, rate in rates.items():
        weight_bytes = roofline.matmul_params(config) * jnp.dtype(dtype).itemsize
        bytes_floor_s = None if bytes_per_s is None else steps * weight_bytes / bytes_per_s
        for workload in workloads:
            flops = run_flops(config, num_prompts=peer.num_prompts,
                              prefix_len=shared_prefix_len(workload),
                              input_len=peer.input_len, output_len=peer.output_len)
            floor_s = max(flops / rate, bytes_floor_s or 0.0)
            rows.append(dict(dtype=dtype, workload=workload, floor=dict(
                run_flops=flops, matmul_flops_per_s=rate, flops_floor_s=flops / rate,
                min_steps=steps, weight_bytes_per_step=weight_bytes,
                memory_bytes_per_s=bytes_per_s, bytes_floor_s=bytes_floor_s, floor_s=floor_s,
                bound="flops" if floor_s == flops / rate else "bytes",
                floor_output_throughput=peer.num_prompts * peer.output_len / floor_s)))
    return rows


def add_floors(rows: Sequence[dict[str, Any]], config, peer: PeerConfig,
               rates: Mapping[str, float], *, bytes_per_s: float | None = None) -> None:
    """Adds to each `vllm_peer.comparison` row of a dtype in `rates` its `floor`, each
    server's `achieved_flops_per_s` and the row's `target_over_floor` (None where a side
    has no figures), in place."""
    floors = {(r["dtype"], r["workload"]): r["floor"] for r in floor_rows(
        config, peer, rates, sorted({r["workload"] for r in rows}), bytes_per_s=bytes_per_s)}
    output_tokens = peer.num_prompts * peer.output_len
    for row in rows:
        floor = floors.get((row["dtype"], row["workload"]))
        if floor is None:
            continue
        row["floor"] = floor
        for server in SERVERS:
            side = row[server]
            if "error" not in side:
                side["achieved_flops_per_s"] = (floor["run_flops"] * side["output_throughput"]
                                                / output_tokens)
        vllm = row["vllm"]
        row["target_over_floor"] = (None if "error" in vllm else TARGET_SPEEDUP
                                    * vllm["output_throughput"] / floor["floor_output_throughput"])


def add_result_floors(result: dict[str, Any], config, rates: Mapping[str, float], *,
                      bytes_per_s: float | None = None) -> None:
    """`add_floors` on a `vllm_peer.run_peer` result (a stored one too: its rows, at its
    PeerConfig), the rates stored beside them as `matmul_flops_per_s` and
    `memory_bytes_per_s`, in place."""
    peer = PeerConfig(**dict(result["config"], kvjax_args=tuple(result["config"]["kvjax_args"])))
    add_floors(result["rows"], config, peer, rates, bytes_per_s=bytes_per_s)
    result["matmul_flops_per_s"] = dict(rates)
    result["memory_bytes_per_s"] = bytes_per_s


def floor_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows' floors as a markdown table (server columns '-' where a row has none)."""
    lines = ["| dtype | workload | run TFLOP | matmul GFLOP/s | FLOPs floor (s) | steps >= | "
             "weight reads floor (s) | floor tok/s | vLLM GFLOP/s | kvjax GFLOP/s | "
             "1.2x vLLM / floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "floor" not in r:
            continue
        f = r["floor"]
        achieved = [format(r[s]["achieved_flops_per_s"] / 1e9, ".1f")
                    if "achieved_flops_per_s" in r.get(s, {}) else "-" for s in SERVERS]
        target = r.get("target_over_floor")
        reads = f.get("bytes_floor_s")
        lines.append(
            f"| {r['dtype']} | {r['workload']} | {f['run_flops'] / 1e12:.2f} | "
            f"{f['matmul_flops_per_s'] / 1e9:.1f} | {f['flops_floor_s']:.1f} | "
            f"{f['min_steps']} | {'-' if reads is None else format(reads, '.1f')} | "
            f"{f['floor_output_throughput']:.1f} | {' | '.join(achieved)} | "
            f"{'-' if target is None else format(target, '.2f')} |")
    return "\n".join(lines)
