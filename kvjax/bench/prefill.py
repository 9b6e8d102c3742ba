"""Prefill throughput of kvjax against a transformers forward pass over the same prompt.

What `scripts/bench_decode.py --prefill_lens=...` runs beside the decode benchmark. One real-text
prompt (corpus text through the model's tokenizer) of `prompt_len` tokens, the same weights:

  * kvjax: an engine with the prefix cache off prefills the prompt in chunks of at most
    `chunk` tokens (its `max_num_batched_tokens` and `max_prefill_chunk`) and samples one
    greedy token. Timed from
    `add_request` to the finished output, host work included. An identical untimed run first
    compiles every step shape the timed runs use.
  * transformers: `model(input_ids, logits_to_keep=1)` under `torch.no_grad()` (the logits
    of the last position only, as `generate` asks for them), one untimed call first.

The two alternate, `repeats` times each, so both see the same background load; the medians
are reported. The floor is the FLOPs of the forward pass (2 per matmul weight per token, the
output head for the last token only, plus causal Q.K and P.V: 2 * N * D * T * (T + 1) per
layer) over the measured matmul rate. The
first generated token is checked against the argmax of transformers' last logits.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import kvjax
from kvjax.bench import roofline
from kvjax.bench.decode import load_hf_model, make_prompts, summarize


def prefill_flops(config, prompt_len: int, num_cached: int = 0) -> float:
    """FLOPs of one causal forward pass over `prompt_len` tokens, logits of the last only;
    with `num_cached`, over the tokens after the first `num_cached` only, whose K/V the
    attention reads from a cache (a prefix-cache hit)."""
    c, t, s = config, prompt_len, num_cached
    if not 0 <= s < t:
        raise ValueError(f"need 0 <= num_cached < prompt_len, got {s} and {t}")
    head = c.hidden_size * c.vocab_size
    attention = 2.0 * c.num_heads * c.head_dim * (t * (t + 1) - s * (s + 1)) * c.num_layers
    return 2.0 * (roofline.matmul_params(c) - head) * (t - s) + 2.0 * head + attention


def _kvjax_prefill_s(engine: kvjax.Engine, prompt: list[int], name: str) -> tuple[float, int]:
    sampling = kvjax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(name, prompt, sampling)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, finished[0].outputs[0].token_ids[0]


def bench_prefill(model: kvjax.Model, hf_model, prompt: list[int], *, chunks: list[int],
                  threads: int, repeats: int, rates: roofline.MachineRates,
                  batch_invariant: bool = False) -> list[dict]:
    """One result per kvjax chunk size and one for transformers (skipped if hf_model is None);
    with `batch_invariant`, one more per chunk size in that mode, timed side by side.

    Each result: system, prompt_len, prefill_s (summarize()'d), tokens_per_s (over the median),
    flops, floor_s, time_over_floor; kvjax results add chunk and first_token_matches_hf.
    """
    engines = {}
    for chunk, invariant in [(c, i) for c in chunks for i in (False, True)
                             if batch_invariant or not i]:
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=chunk, max_prefill_chunk=chunk,
            max_model_len=len(prompt) + 1, enable_prefix_cache=False,
            batch_invariant=invariant))
        _kvjax_prefill_s(engine, prompt, "warm")
        engines[(chunk, invariant)] = engine
    times: dict[object, list[float]] = {key: [] for key in engines}
    tokens = {}
    hf_token = None
    if hf_model is not None:
        import torch

        torch.set_num_threads(threads)
        input_ids = torch.tensor([prompt], dtype=torch.long)

        def hf_forward() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                logits = hf_model(input_ids, logits_to_keep=1).logits[0, -1]
            elapsed = time.perf_counter() - start
            nonlocal hf_token
            hf_token = int(logits.argmax())
            return elapsed

        hf_forward()
        times["hf"] = []
    for i in range(repeats):
        for key, engine in engines.items():
            elapsed, tokens[key] = _kvjax_prefill_s(engine, prompt, f"timed-{i}")
            times[key].append(elapsed)
        if hf_model is not None:
            times["hf"].append(hf_forward())
    flops = prefill_flops(model.config, len(prompt))
    floor_s = flops / rates.matmul_flops_per_s
    results = []
    for key, samples in times.items():
        stats = summarize(samples)
        result = dict(
            system=f"transformers-{threads}t" if key == "hf"
            else "kvjax-paged" + ("-invariant" if key[1] else ""),
            prompt_len=len(prompt), prefill_s=stats, tokens_per_s=len(prompt) / stats["median"],
            flops=flops, floor_s=floor_s, time_over_floor=stats["median"] / floor_s)
        if key != "hf":
            result.update(chunk=key[0], attention=engines[key].attention_name,
                          first_token_matches_hf=None if hf_token is None
                          else tokens[key] == hf_token)
        results.append(result)
    return results


def format_prefill_table(results: list[dict]) -> str:
    """A markdown table of bench_prefill results."""
    lines = ["| system | prompt tokens | chunk | prefill s (median) | p90 | tokens/s | floor s "
             "| time / floor | first token = HF |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['prompt_len']} | {r.get('chunk', '-')} "
            f"| {r['prefill_s']['median']:.3f} | {r['prefill_s']['p90']:.3f} "
            f"| {r['tokens_per_s']:.0f} | {r['floor_s']:.3f} | {r['time_over_floor']:.2f} "
            f"| {r.get('first_token_matches_hf', '-')} |")
    return "\n".join(lines)


def speedups(results: list[dict]) -> dict:
    """kvjax tokens/s over transformers' per (prompt_len, chunk); empty without transformers."""
    out = {}
    for r in results:
        if "chunk" not in r:
            continue
        hf = [h for h in results if "chunk" not in h and h["prompt_len"] == r["prompt_len"]]
        if hf:
            mode = ",invariant" if r["system"].endswith("-invariant") else ""
            out[f"ctx={r['prompt_len']},chunk={r['chunk']}{mode}"] = float(
                np.round(r["tokens_per_s"] / hf[0]["tokens_per_s"], 3))
    return out


def run(model: kvjax.Model, *, prompt_lens: list[int], chunks: list[int], threads: int,
        skip_hf: bool, repeats: int, seed: int, batch_invariant: bool = False) -> dict:
    """bench_prefill at every prompt length, printing the table; a JSON-ready dict."""
    rates = roofline.measure_machine()
    hf_model = None if skip_hf else load_hf_model()
    results = []
    for prompt_len in prompt_lens:
        prompt = make_prompts(model, 1, prompt_len, seed)[0]
        results += bench_prefill(model, hf_model, prompt, chunks=chunks, threads=threads,
                                 repeats=repeats, rates=rates,
                                 batch_invariant=batch_invariant)
        print(format_prefill_table(results).splitlines()[-1], flush=True)
    print(format_prefill_table(results))
    ratios = speedups(results)
    print(f"prefill speedup over transformers: {ratios}")
    return dict(rates=dataclasses.asdict(rates), results=results, speedup_over_hf=ratios)
