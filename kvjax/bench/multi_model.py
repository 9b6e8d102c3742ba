"""Several models under one device budget, elastic pool vs static partitions: what
`scripts/bench_multi_model.py` runs.

The workload: requests for N models arrive as a Poisson process; in each phase of `phase_s`
seconds only `num_hot` models (drawn anew each phase) receive requests, so the active set keeps
changing (Prism's traces: a third to a half of the models active, the set changing many times
an hour). Each policy serves the same requests on the real clock from one `MultiModelEngine`
with the same budget, and reports:

  kv_utilization: live KV bytes over the budget's KV share (budget - resident weights),
    time-weighted over steps;
  ttft p50 / p99: first token - arrival (waiting for a model's weights included);
  throughput: generated tokens / makespan;
  weight bytes moved to host and back, preemptions, the most bytes the ledger held.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import tqdm

from kvjax.bench.decode import environment
from kvjax.engine.multi import ModelSpec, MultiModelEngine, PoolConfig
from kvjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class PoolRequest:
    arrival: float  # seconds from the start
    model: str
    request_id: str
    prompt: list[int]
    max_new_tokens: int


def switching_requests(models: Sequence[str], *, num_requests: int, rate: float, phase_s: float,
                       num_hot: int, prompt_lens: tuple[int, int], max_new_tokens: int,
                       vocab_size: int, seed: int) -> list[PoolRequest]:
    """Poisson arrivals at `rate`/s; each goes to one of the phase's `num_hot` hot models."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    hot: dict[int, list[str]] = {}
    out = []
    for i, t in enumerate(arrivals):
        phase = int(t // phase_s)
        if phase not in hot:
            hot[phase] = list(rng.choice(list(models), num_hot, replace=False))
        length = int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))
        prompt = [1] + rng.integers(3, vocab_size, length - 1).tolist()
        out.append(PoolRequest(float(t), str(rng.choice(hot[phase])), f"q{i}", prompt,
                               max_new_tokens))
    return out


def serve(specs: dict[str, ModelSpec], pool: PoolConfig, requests: Sequence[PoolRequest],
          *, warmup: bool = True) -> dict:
    """Serves `requests` on the real clock; returns the metrics of the module docstring."""
    mm = MultiModelEngine(specs, pool)
    if warmup:
        mm.warmup()
    pending = sorted(requests, key=lambda r: r.arrival)
    done, util = {}, []
    progress = tqdm.tqdm(total=len(requests), desc=pool.policy, unit="req")
    start = last = time.perf_counter()
    while pending or mm.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            mm.add_request(r.request_id, r.prompt,
                           SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True),
                           model=r.model, arrival_time=start + r.arrival)
        if not mm.has_unfinished():
            time.sleep(max(pending[0].arrival - now, 0))
            continue
        finished = mm.step()
        done.update((o.request_id, o) for o in finished)
        progress.update(len(finished))
        progress.set_postfix(preempted=sum(e.stats.get("preemptions", 0)
                                           for e in mm.engines.values()), refresh=False)
        t = time.perf_counter()
        util.append((t - last, mm.kv_utilization()))
        last = t
    makespan = time.perf_counter() - start
    progress.close()
    ttft = np.array([o.first_token_time - o.arrival_time for o in done.values()])
    tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    weights, fractions = np.array([u[0] for u in util]), np.array([u[1] for u in util])
    summary = mm.summary()
    return dict(
        policy=pool.policy, num_requests=len(done), makespan_s=makespan,
        kv_utilization=float((weights * fractions).sum() / weights.sum()),
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
        throughput_tok_s=tokens / makespan,
        weight_bytes_to_host=summary["weight_bytes_to_host"],
        weight_bytes_to_device=summary["weight_bytes_to_device"],
        weight_moves=summary["weight_offloads"] + summary["weight_loads"],
        preemptions=sum(e.stats.get("preemptions", 0) for e in mm.engines.values()),
        max_used_bytes=summary["max_used_bytes"], budget_bytes=summary["budget_bytes"],
        frame_bytes=summary["frame_bytes"],
        page_sizes={n: m["page_size"] for n, m in summary["models"].items()},
        outputs={r: done[r].outputs[0].token_ids for r in sorted(done)})


def compare(specs: dict[str, ModelSpec], budget_bytes: int, requests: Sequence[PoolRequest],
            policies: Sequence[str] = ("static", "elastic")) -> dict:
    """Each policy on the same requests and budget, one after the other."""
    results = [serve(specs, PoolConfig(budget_bytes, policy=p), requests) for p in policies]
    outputs = [r.pop("outputs") for r in results]
    model_of = {r.request_id: r.model for r in requests}
    differ = sorted({model_of[i] for o in outputs[1:] for i in o if o[i] != outputs[0][i]})
    return dict(environment=environment(), results=results,
                identical_outputs=not differ, models_with_other_outputs=differ)


def format_table(results: Sequence[dict]) -> str:
    header = ("| policy | KV utilization | TTFT p50 s | TTFT p99 s | throughput tok/s "
              "| weights to host MB | weights to device MB | preemptions | max used / budget |")
    rows = [header, "|" + "---|" * 9]
    for r in results:
        rows.append(
            f"| {r['policy']} | {r['kv_utilization']:.2f} | {r['ttft_p50_s']:.2f} "
            f"| {r['ttft_p99_s']:.2f} | {r['throughput_tok_s']:.1f} "
            f"| {r['weight_bytes_to_host'] / 1e6:.0f} | {r['weight_bytes_to_device'] / 1e6:.0f} "
            f"| {r['preemptions']} | {r['max_used_bytes'] / r['budget_bytes']:.3f} |")
    return "\n".join(rows)
