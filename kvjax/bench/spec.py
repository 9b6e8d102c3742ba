"""Speculative decoding against plain decoding, side by side: what `scripts/bench_spec.py` runs.

For each setting (batch B, prompt length L) every variant (plain decoding, then each draft
method at each gamma) gets its own engine on the same weights and decodes the same B real-text
prompts greedily for `new_tokens` tokens; the engines take turns, one step each, so that all
see the same background load. Plain decoding runs synchronously like the speculative engines
(asynchronous, its device work would run on under the next engine's step and count there;
it hides 1-2% of host time on this model). An untimed run of the
same requests first compiles the decode, draft and verify shapes and leaves the prompts in the
prefix cache, so the timed run prefills only each prompt's last partial page and all B
sequences decode together from its first steps; a timed step that still compiles is left out
(tokens and time). Only the decode phase is timed: the steps after the last one that computes
prompt tokens. Its tokens are the ones the steps emit (kept drafts + one per verify row, or
one per plain decode row), so

  decode tok/s = emitted tokens / wall time of those steps,    speed-up = variant / plain,

and the acceptance rate (kept / proposed drafts) and tokens per verify row come from the engine's
counters. Greedy speculative outputs must equal plain decoding's (`identical`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import kvjax
from kvjax.bench.decode import environment, make_prompts
from kvjax.scheduler.spec import SpecConfig

_COUNTERS = ("decode_tokens", "prefill_tokens", "spec_proposed", "spec_accepted",
             "spec_verify_rows", "spec_draft_steps")


@dataclasses.dataclass(frozen=True)
class Variant:
    method: str  # 'none' (plain decoding) or a draft method
    gamma: int = 0
    adaptive: bool = False

    @property
    def name(self) -> str:
        if self.method == "none":
            return "plain"
        return f"{self.method}-g{self.gamma}" + ("-adaptive" if self.adaptive else "")

    def spec(self, options: dict) -> SpecConfig:
        if self.method == "none":
            return SpecConfig()
        return SpecConfig(self.method, self.gamma, dict(options.get(self.method, {})),
                          adaptive=self.adaptive)


def parse_variants(methods: Sequence[str], gammas: Sequence[int], *, adaptive: bool = False
                   ) -> list[Variant]:
    """Plain decoding first, then every method at every gamma (and adaptively, if asked)."""
    modes = (False, True) if adaptive else (False,)
    return [Variant("none")] + [Variant(m, g, a) for m in methods if m != "none"
                                for g in gammas for a in modes]


@dataclasses.dataclass
class _Run:
    engine: kvjax.Engine
    steps: list[dict] = dataclasses.field(default_factory=list)
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def step(self) -> None:
        stats, compiles = self.engine.stats, self.engine.num_compiles
        before = {k: stats[k] for k in _COUNTERS}
        start = time.perf_counter()
        finished = self.engine.step()
        wall = time.perf_counter() - start
        delta = {k: stats[k] - before[k] for k in _COUNTERS}
        self.steps.append(dict(
            wall_s=wall, compiled=self.engine.num_compiles != compiles,
            prefill=delta["prefill_tokens"] > 0, draft=delta["spec_draft_steps"] > 0,
            emitted=delta["decode_tokens"] - delta["spec_proposed"] + delta["spec_accepted"]))
        self.outputs.update({o.request_id: o.outputs[0].token_ids for o in finished})


def _result(name: str, run: _Run, stats_before: dict) -> dict:
    last_prefill = max((i for i, s in enumerate(run.steps) if s["prefill"]), default=-1)
    decode = [s for s in run.steps[last_prefill + 1:] if not s["compiled"]]
    wall = sum(s["wall_s"] for s in decode)
    emitted = sum(s["emitted"] for s in decode)
    stats = {k: run.engine.stats[k] - stats_before[k] for k in _COUNTERS}
    rows = stats["spec_verify_rows"]
    return dict(
        system=name, decode_steps=len(decode), draft_steps=sum(s["draft"] for s in decode),
        compiled_steps_left_out=sum(s["compiled"] for s in run.steps[last_prefill + 1:]),
        emitted_tokens=emitted, decode_s=wall,
        decode_tok_s=emitted / wall if wall else None,
        acceptance_rate=stats["spec_accepted"] / stats["spec_proposed"]
        if stats["spec_proposed"] else None,
        tokens_per_step=(rows + stats["spec_accepted"]) / rows if rows else None)


def bench_setting(model: kvjax.Model, variants: Sequence[Variant], prompts: list[list[int]],
                  new_tokens: int, *, page_size: int, options: dict,
                  engine_overrides: dict | None = None) -> list[dict]:
    """One (B, L) setting: every variant's decode throughput, run side by side.

    engine_overrides: EngineConfig fields every variant shares (a retention policy, a codec).
    """
    batch, prompt_len = len(prompts), len(prompts[0])
    gamma = max(v.gamma for v in variants)
    engines = {}
    sampling = kvjax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for variant in variants:
        engine = kvjax.Engine(model, kvjax.EngineConfig(
            page_size=page_size, max_num_seqs=batch, enable_prefix_cache=True,
            max_model_len=prompt_len + new_tokens + gamma + 1, spec=variant.spec(options),
            async_scheduling=False, **(engine_overrides or {})))
        engine.generate(prompts, sampling)  # compiles, caches the prompts (untimed)
        engines[variant.name] = engine
    before = {name: dict(e.stats) for name, e in engines.items()}
    runs = {name: _Run(e) for name, e in engines.items()}
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"timed-{i}", prompt, sampling)
    while any(run.engine.has_unfinished() for run in runs.values()):
        for run in runs.values():
            if run.engine.has_unfinished():
                run.step()
    results = [_result(name, run, before[name]) for name, run in runs.items()]
    ids = [f"timed-{i}" for i in range(batch)]
    plain = results[0]
    for result, run in zip(results, runs.values(), strict=True):
        result.update(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                      identical=[run.outputs[r] for r in ids]
                      == [runs[plain["system"]].outputs[r] for r in ids],
                      speedup=(result["decode_tok_s"] / plain["decode_tok_s"]
                               if result["decode_tok_s"] and plain["decode_tok_s"] else None))
    return results


def run(model: kvjax.Model, *, settings: Sequence[tuple[int, int]], variants: Sequence[Variant],
        new_tokens: int, page_size: int = 16, options: dict | None = None, seed: int = 0,
        engine_overrides: dict | None = None, log=print) -> dict:
    """Every setting (B, L) with every variant; returns the JSON report. engine_overrides:
    EngineConfig fields of every engine (`bench_setting`)."""
    results = []
    for batch, prompt_len in settings:
        prompts = make_prompts(model, batch, prompt_len, seed + prompt_len)
        rows = bench_setting(model, variants, prompts, new_tokens, page_size=page_size,
                             options=options or {}, engine_overrides=engine_overrides)
        log(format_table(rows))
        results += rows
    return dict(env=environment(), results=results)


def format_table(results: Sequence[dict]) -> str:
    """Markdown: one row per system and setting."""
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = ["| system | B | prompt | decode tok/s | speed-up | acceptance | tokens/verify "
             "row | draft steps | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['prompt_len']} | {cell(r['decode_tok_s'], '.1f')}"
            f" | {cell(r['speedup'], '.2f')} | {cell(r['acceptance_rate'], '.2f')} | "
            f"{cell(r['tokens_per_step'], '.2f')} | {r['draft_steps']} | {r['identical']} |")
    return "\n".join(lines)
