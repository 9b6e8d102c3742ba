"""Host-resident rows vs swap vs recompute when the device pool holds a quarter of the working
set: tokens/s and TPOT p99 on a simulated clock (every figure here is simulated).

The scenario: `num_seqs` sequences, each with `context` tokens already in its KV, each wants
`new_tokens` more (greedy decode). The device pool holds `device_fraction` of their KV; the rest
lives in host memory. Three ways to serve them:

* **swap**: as many sequences as the pool holds decode to the end, then the next group's KV
  comes in over the link (swap-in), and so on (first come, first served).
* **recompute**: as swap, but a group's KV is recomputed by a prefill instead of loaded.
* **host rows**: each wave also decodes sequences whose KV stays in host memory, their
  attention computed on the host (`kvjax.engine.host_rows`) beside the device's step, so a step
  takes max(device time, host attention time) plus the link time of the queries and partial
  outputs: `host_all` puts every sequence the pool cannot hold there (one wave), `neo` as many
  as the `neo` split policy balances against the device step.
* **controller**: the joint KV controller (`kvjax.scheduler.controller`, action "host" beside
  "swap" and "recompute") decides, one sequence beyond the pool at a time, how to make room
  for it: a host-resident row while that is its cheapest action (each one priced with the host
  attention the earlier ones already put beside the device's step), else its cheapest of swap
  and recompute for all the rest (`controller_choice`).

Device times come from a roofline of the stated accelerator (weights and KV bytes read over HBM,
2 * params FLOPs per token); link times from the stated link bandwidth (per direction);
the host's decode-attention rate is measured on this machine (`measure_attention_rate`: the
host part of `kvjax.engine.host_rows` over float32 pages, KV bytes read per second) and
scaled by `host_scale` (1: this machine as it is). A sequence's TPOT samples are the gaps
between its tokens, counted from time 0 (its last token before the run); a sequence waiting
for its group's turn waits in its first gap.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine import host_rows
from kvjax.kv.state import PagedKV

# Per-direction bandwidths of the links compared (nominal figures of the specifications).
LINKS = {
    "pcie5_x16": 64e9,  # PCIe 5.0 x16: 32 GT/s x 16 lanes, about 64 GB/s each way
    "nvlink_c2c": 450e9,  # NVLink-C2C (Grace Hopper): 900 GB/s total, 450 GB/s each way
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """The simulated workload and hardware.

    Attributes:
      num_seqs, context, new_tokens: the working set (see the module doc).
      device_fraction: the share of the working set's KV the device pool holds.
      kv_bytes_per_token: KV bytes of one token over every layer (bf16 Llama-3-8B: 32 layers x
        8 kv heads x 128 x 2 (K, V) x 2 bytes).
      param_bytes, num_params: the model's weights (read once per step) and parameter count.
      hbm_bytes_per_s, device_flops: the accelerator (H100 SXM: 3.35 TB/s, ~990 dense bf16
        TFLOP/s).
      host_scale: the host's attention rate over this machine's (more cores, more bandwidth).
      query_bytes: bytes one row's query and partial output cross the link with per step (all
        layers: q [N, D] out, out [N, D] and lse [N] back).
    """

    num_seqs: int = 64
    context: int = 4096
    new_tokens: int = 128
    device_fraction: float = 0.25
    kv_bytes_per_token: int = 32 * 8 * 128 * 2 * 2
    param_bytes: float = 16e9
    num_params: float = 8e9
    hbm_bytes_per_s: float = 3.35e12
    device_flops: float = 990e12
    host_scale: float = 1.0
    query_bytes: int = 32 * (32 * 128 * 2 * 2 + 32 * 4)


def measure_attention_rate(*, num_rows: int = 8, context: int = 2048, kv_heads: int = 8,
                           head_dim: int = 128, page_size: int = 16, repeats: int = 5) -> float:
    """The host part of host-resident decode attention on this machine: KV bytes read per
    second (float32 pages, one layer, best of `repeats`)."""
    pages_per_row = context // page_size
    num_pages = num_rows * pages_per_row
    rng = np.random.default_rng(0)
    shape = (1, num_pages, page_size, kv_heads, head_dim)
    kv = PagedKV(k_pages=jnp.asarray(rng.normal(size=shape), jnp.float32),
                 v_pages=jnp.asarray(rng.normal(size=shape), jnp.float32))
    q = jnp.asarray(rng.normal(size=(num_rows, 4 * kv_heads, head_dim)), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(num_rows, pages_per_row), jnp.int32)
    lens = jnp.full(num_rows, context, jnp.int32)
    part = jax.jit(functools.partial(host_rows.host_decode_attention, soft_cap=None,
                                     pages_per_block=8))
    jax.block_until_ready(part(kv, jnp.int32(0), q, tables, lens, jnp.ones_like(lens)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(part(kv, jnp.int32(0), q, tables, lens, jnp.ones_like(lens)))
        best = min(best, time.perf_counter() - t0)
    return 2 * num_rows * context * kv_heads * head_dim * 4 / best


def _device_step_s(s: Scenario, num_rows: int, device_kv_tokens: float) -> float:
    """One decode step of `num_rows` rows reading `device_kv_tokens` tokens of KV on device."""
    memory = (s.param_bytes + device_kv_tokens * s.kv_bytes_per_token) / s.hbm_bytes_per_s
    return max(memory, 2 * s.num_params * num_rows / s.device_flops)


def _prefill_s(s: Scenario, num_rows: int) -> float:
    """Recomputing `num_rows` sequences' KV of `context` tokens (weights and attention FLOPs)."""
    tokens = num_rows * s.context
    flops = 2 * s.num_params * tokens + 2 * num_rows * s.context ** 2 * \
        s.kv_bytes_per_token / 4  # QK^T and PV: ~2 * S^2 * (K * D * L) per row, causal halved
    return max(flops / s.device_flops, s.param_bytes / s.hbm_bytes_per_s)


def _summary(gaps: list[float], total_s: float, s: Scenario) -> dict:
    return dict(tokens_per_s=s.num_seqs * s.new_tokens / total_s, duration_s=total_s,
                tpot_p50_ms=1e3 * float(np.percentile(gaps, 50)),
                tpot_p99_ms=1e3 * float(np.percentile(gaps, 99)),
                tpot_max_ms=1e3 * float(np.max(gaps)))


def neo_host_rows(s: Scenario, host_rate: float) -> int:
    """NEO's balance for this scenario: the most sequences beyond those the device pool holds
    whose host attention (at their full context) fits within the device's step for the wave
    (the rule of the `neo` split policy, `kvjax.scheduler.host_split.Neo`)."""
    group = _group(s)
    per_row = s.context * s.kv_bytes_per_token / (host_rate * s.host_scale)
    k = 0
    while (group + k < s.num_seqs and
           (k + 1) * per_row <= _device_step_s(s, group + k + 1, group * s.context)):
        k += 1
    return k


def _group(s: Scenario) -> int:
    return max(1, int(s.num_seqs * s.device_fraction))


def simulate(s: Scenario, link_bytes_per_s: float, *, host_rows_per_wave: int = 0,
             host_rate: float = 0.0, recompute: bool = False) -> dict:
    """Waves of sequences decode to the end in turn: each wave the sequences the device pool
    holds, plus `host_rows_per_wave` whose KV stays in host memory and whose attention the host
    computes beside the device's step. Each next wave's device share comes in over the link
    (swap-in) or is recomputed; its host rows need no transfer."""
    group = _group(s)
    wave = group + host_rows_per_wave
    gaps, now, ratio = [], 0.0, 0.0
    for first in range(0, s.num_seqs, wave):
        rows = min(wave, s.num_seqs - first)
        on_device = min(rows, group)
        on_host = rows - on_device
        if first:  # the last wave finished: bring the next one's device share in
            now += (_prefill_s(s, on_device) if recompute
                    else on_device * s.context * s.kv_bytes_per_token / link_bytes_per_s)
        wait = now
        for step in range(s.new_tokens):
            device = _device_step_s(s, rows, on_device * s.context + rows * step)
            dt = device
            if on_host:
                host = on_host * s.context * s.kv_bytes_per_token / (host_rate * s.host_scale)
                dt = max(device, host) + on_host * s.query_bytes / link_bytes_per_s
                ratio = max(ratio, host / device)
            now += dt
            gaps += [dt + (wait if step == 0 else 0.0)] * rows
    out = _summary(gaps, now, s)
    out.update(host_rows_per_wave=host_rows_per_wave, host_over_device_time=ratio)
    return out


def controller_choice(s: Scenario, host_rate: float, link_bytes_per_s: float
                      ) -> tuple[int, str]:
    """(host rows per wave, how the rest are served: 'swap' or 'recompute') as the joint
    controller prices them: each further sequence beyond the pool is a victim that makes room
    for a waiting one with a deadline, its host attention beside a device step already
    shortened by the host rows chosen before it."""
    from kvjax.scheduler import controller as ctl

    group, page = _group(s), 16
    host_tokens_per_s = host_rate * s.host_scale / s.kv_bytes_per_token
    device_s = _device_step_s(s, group, group * s.context)
    recompute = s.context / _prefill_s(s, 1)
    victim = ctl.SeqState(
        seq_id="victim", request_id="victim", tenant=None, priority=0, status="running",
        age_s=1.0, num_tokens=s.context, num_computed=s.context, cached_tokens=s.context,
        pages_held=-(-s.context // page), slack_s=ctl.INF, retention_budget=None,
        kl_spent=0.0, kl_budget=0.0)
    waiting = dataclasses.replace(victim, seq_id="w", request_id="w", priority=1,
                                  status="waiting", num_computed=0, cached_tokens=0,
                                  pages_held=0, slack_s=10 * s.context / recompute)
    joint = ctl.make_controller("joint", host_horizon_steps=s.new_tokens)
    rest = "swap"
    for k in range(s.num_seqs - group + 1):
        rates = ctl.HostRowRates(free_host_pages=2**31, host_tokens_per_s=host_tokens_per_s,
                                 device_step_s=device_s - k * s.context / host_tokens_per_s)
        state = ctl.ControlState(
            now=0.0, page_size=page, num_pages=group * -(-s.context // page), free_pages=0,
            max_num_seqs=s.num_seqs, kv_bytes_per_token=s.kv_bytes_per_token,
            swap_bytes_per_s=link_bytes_per_s, recompute_tokens_per_s=recompute,
            can_swap=True, demote_ratios={}, retention_range=None, seqs=(victim, waiting),
            host_rows=rates)
        d = joint.decide(state)
        if k == s.num_seqs - group or not d.to_host:
            rest = "swap" if d.swap.get("victim", True) else "recompute"
            return k, rest
    return s.num_seqs - group, rest


def run(s: Scenario, host_rate: float | None = None) -> dict:
    """Every strategy on every link; returns {'rows': {name: figures}, ...}: host_all (every
    sequence the pool cannot hold on the host), neo (as many as the neo policy balances),
    swap, recompute and controller (the joint controller's choice)."""
    host_rate = measure_attention_rate() if host_rate is None else host_rate
    neo = neo_host_rows(s, host_rate)
    rows = {}
    for link, bandwidth in LINKS.items():
        rows[f"{link}/host_all"] = simulate(s, bandwidth, host_rate=host_rate,
                                            host_rows_per_wave=s.num_seqs - _group(s))
        rows[f"{link}/neo"] = simulate(s, bandwidth, host_rate=host_rate,
                                       host_rows_per_wave=neo)
        rows[f"{link}/swap"] = simulate(s, bandwidth)
        rows[f"{link}/recompute"] = simulate(s, bandwidth, recompute=True)
        k, rest = controller_choice(s, host_rate, bandwidth)
        rows[f"{link}/controller"] = simulate(s, bandwidth, host_rate=host_rate,
                                              host_rows_per_wave=k,
                                              recompute=rest == "recompute")
    return dict(rows=rows, host_attention_bytes_per_s_measured=host_rate,
                scenario=dataclasses.asdict(s), links_bytes_per_s=LINKS, clock="simulated")
