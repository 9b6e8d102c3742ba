"""The compute floor of a vLLM peer workload (`kvjax.bench.vllm_peer`): what the whole run's
FLOPs take at this machine's measured matmul rate, and so the most output tokens/s any server
could reach on it.

    rates = measure_matmul_rates(("float32",))
    floors = floor_rows(kvjax.load_model().config, PeerConfig(), rates, ("random",))
    print(floor_table(floors))

The run's FLOPs (`run_flops`): every request's prefill and decode steps, projections, MLP,
output head and attention (`prefill.prefill_flops`, `roofline.decode_step_flops`), from the
model config and the workload's prompt, output and shared-prefix lengths. A shared prefix is
counted once, as an ideal prefix cache computes it: the first request prefills its whole prompt,
every other one only the tokens after the prefix (reading the prefix's K/V). The rate is
`roofline.measure_matmul_rate` in the served dtype (operands of that dtype summed in float32,
as the model's matmuls are), the probe `bench_decode`'s floors use.

Per dtype and workload (`add_floors`): `run_flops`, `matmul_flops_per_s`, `floor_s` (the FLOPs
over the rate), `floor_output_throughput` (the run's output tokens over `floor_s`); each
server's `achieved_flops_per_s` (the run's FLOPs over its run time: output tokens over its
output tokens/s); and `target_over_floor`, `TARGET_SPEEDUP` x vLLM's output tokens/s over the
floor throughput: above 1, the target asks for more than the matmuls can do at the measured
rate. The floor leaves out the bytes each step reads (how many steps a run takes is the
server's choice, not the workload's) and all work besides matmuls and attention, so it is
below what any server can reach. A Poisson workload is bound by its arrival rate instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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


def floor_rows(config, peer: PeerConfig, rates: Mapping[str, float],
               workloads: Sequence[str] = tuple(WORKLOADS)) -> list[dict[str, Any]]:
    """One row per dtype of `rates` and workload: dtype, workload and its `floor` (the keys
    of the module docstring), without servers."""
    rows = []
    for dtype, rate in rates.items():
        for workload in workloads:
            flops = run_flops(config, num_prompts=peer.num_prompts,
                              prefix_len=shared_prefix_len(workload),
                              input_len=peer.input_len, output_len=peer.output_len)
            floor_s = flops / rate
            rows.append(dict(dtype=dtype, workload=workload, floor=dict(
                run_flops=flops, matmul_flops_per_s=rate, floor_s=floor_s,
                floor_output_throughput=peer.num_prompts * peer.output_len / floor_s)))
    return rows


def add_floors(rows: Sequence[dict[str, Any]], config, peer: PeerConfig,
               rates: Mapping[str, float]) -> None:
    """Adds to each `vllm_peer.comparison` row of a dtype in `rates` its `floor`, each
    server's `achieved_flops_per_s` and the row's `target_over_floor` (None where a side
    has no figures), in place."""
    floors = {(r["dtype"], r["workload"]): r["floor"] for r in floor_rows(
        config, peer, rates, sorted({r["workload"] for r in rows}))}
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


def add_result_floors(result: dict[str, Any], config, rates: Mapping[str, float]) -> None:
    """`add_floors` on a `vllm_peer.run_peer` result (a stored one too: its rows, at its
    PeerConfig), the rates stored beside them as `matmul_flops_per_s`, in place."""
    peer = PeerConfig(**dict(result["config"], kvjax_args=tuple(result["config"]["kvjax_args"])))
    add_floors(result["rows"], config, peer, rates)
    result["matmul_flops_per_s"] = dict(rates)


def floor_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows' floors as a markdown table (server columns '-' where a row has none)."""
    lines = ["| dtype | workload | run TFLOP | matmul GFLOP/s | floor (s) | floor tok/s | "
             "vLLM GFLOP/s | kvjax GFLOP/s | 1.2x vLLM / floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "floor" not in r:
            continue
        f = r["floor"]
        achieved = [format(r[s]["achieved_flops_per_s"] / 1e9, ".1f")
                    if "achieved_flops_per_s" in r.get(s, {}) else "-" for s in SERVERS]
        target = r.get("target_over_floor")
        lines.append(
            f"| {r['dtype']} | {r['workload']} | {f['run_flops'] / 1e12:.2f} | "
            f"{f['matmul_flops_per_s'] / 1e9:.1f} | {f['floor_s']:.1f} | "
            f"{f['floor_output_throughput']:.1f} | {' | '.join(achieved)} | "
            f"{'-' if target is None else format(target, '.2f')} |")
    return "\n".join(lines)
