"""What in-place demotion costs in quality and saves in bytes, measured on a real model.

Each plan serves one prompt at a time on an engine whose pool is a mixed-precision pool
(`kvjax.kv.mixed`), prefills the prompt, then re-encodes pages in place with a
`KVOpKind.DEMOTE` op applied by the runner (as a controller's decision would) and decodes
greedily; exact KV scores the same tokens teacher-forced, and the per-token KL and top-1
agreement are `kvjax.bench.metrics.quality_stats`'. A plan demotes either every full page of
the prompt ("all": what the controller's KL table measures) or its cold pages only (every full
page but the last `hot_pages`: what in-place demotion does); bytes are the ledger's
(`kvjax.memory.precision.PrecisionLedger`), relative to the exact pages.

The engine is built for exact KV and its pool swapped for a mixed one of the same pages, with a
ledger of unbounded budget, so the demotion applied is the plan's alone (an engine with
`kv_codec="mixed"` demotes when its controller decides); the prefix cache is off, so every
plan prefills its prompt anew, exact, before it demotes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.bench import runner
from kvjax.bench.metrics import quality_stats
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.runner import StepObserver
from kvjax.engine.step import LogitsMode, StepShape
from kvjax.kv import mixed
from kvjax.memory.precision import PrecisionLedger
from kvjax.memory.tiers import TierConfig
from kvjax.models.model import Model
from kvjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to demote a prompt's pages: keys at `k_bits`, values at `v_bits`, on every
    full page ("all") or all but the last `hot_pages` ("cold")."""

    k_bits: int
    v_bits: int
    scope: str = "cold"
    hot_pages: int = 2


PLANS = {
    "exact (no demotion)": Plan(0, 0),
    "cold int8": Plan(8, 8),
    "cold K8V4": Plan(8, 4),
    "cold int4": Plan(4, 4),
    "all int8": Plan(8, 8, "all"),
    "all int4": Plan(4, 4, "all"),
}


class _Tap(StepObserver):
    """Each step's logits of an engine's one real row."""

    def __init__(self):
        self.rows: list[np.ndarray] = []

    def after_step(self, shape: StepShape, host_input: dict[str, np.ndarray], out) -> None:
        (row,) = np.flatnonzero(host_input["q_lens"])
        self.rows.append(np.asarray(out.logits[row], np.float64))  # [V]


def _demoted_run(model: Model, config: EngineConfig, prompt: Sequence[int], plan: Plan,
                 num_tokens: int) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens after the plan's demotion, their logits [n, V], and the bytes the
    prompt's full pages hold over their exact bytes."""
    engine = Engine(model, config)
    page_size = config.page_size
    engine.runner.kv = mixed.init_mixed_kv(model.config, engine.runner.kv.num_pages, page_size)
    spec = mixed.cache_spec(model.config, page_size)
    ledger = PrecisionLedger(spec, engine.runner.kv.num_pages, float("inf"))
    tap = _Tap()
    engine.add_step_observer(tap)
    engine.add_request("inplace", list(prompt),
                       SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
    outputs = engine.step(logits_mode=LogitsMode.LAST)  # the whole prompt: one chunk
    (seq,) = engine.scheduler.running
    table = engine.kv_cache.block_table(seq.seq_id)
    full = table[:len(prompt) // page_size]
    ledger.hold(full)
    pages = full if plan.scope == "all" else full[:max(len(full) - plan.hot_pages, 0)]
    op = ledger.demote(pages, plan.k_bits, plan.v_bits) if pages else None
    if op is not None:
        engine.runner.apply_ops([op])
    while engine.has_unfinished():
        outputs += engine.step(logits_mode=LogitsMode.LAST)
    (out,) = outputs
    ratio = ledger.bytes_held / (len(full) * spec.page_bytes_at(0, 0)) if full else 1.0
    return out.outputs[0].token_ids, np.stack(tap.rows[-num_tokens:]), ratio


def measure(model: Model, prompts: Sequence[Sequence[int]], num_tokens: int,
            plans: dict[str, Plan] | None = None, *, page_size: int = 16
            ) -> dict[str, dict[str, float]]:
    """Plan name -> KL mean / p99 / max, top-1 agreement and the bytes ratio of the
    prompts' full pages, over `prompts` and `num_tokens` greedy tokens each."""
    longest = max(len(p) for p in prompts) + num_tokens
    chunk = 1 << (longest - 1).bit_length()
    config = EngineConfig(page_size=page_size, max_num_seqs=1, max_prefill_seqs=1,
                          max_prefill_chunk=chunk, min_chunk_bucket=chunk,
                          max_num_batched_tokens=chunk, max_model_len=2 * chunk,
                          enable_prefix_cache=False, tiers=TierConfig())
    rows = {}
    for name, plan in (plans or PLANS).items():
        refs, tests, ratios = [], [], []
        for prompt in prompts:
            tokens, logits, ratio = _demoted_run(model, config, prompt, plan, num_tokens)
            ref = runner.score_tokens(config, model, list(prompt) + tokens)
            refs.append(ref[len(prompt) - 1:])
            shifted = logits - logits.max(-1, keepdims=True)
            tests.append(shifted - np.log(np.exp(shifted).sum(-1, keepdims=True)))
            ratios.append(ratio)
        stats = quality_stats(np.concatenate(refs), np.concatenate(tests))
        rows[name] = dict(stats, bytes_ratio=float(np.mean(ratios)))
    return rows
