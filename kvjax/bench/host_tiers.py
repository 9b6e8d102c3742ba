"""Host time per engine step on a multi-turn chat that goes through a host tier.

Conversations are served in rounds (every conversation's turn k, then turn k+1) on a device pool
too small for the whole working set, so later turns find their earlier turns' pages in the host
tier. Each step's host time (scheduling, input building, commit, tier bookkeeping) is read from
`engine.stats["host_time_s"]`; steps that compiled are left out.
"""

from __future__ import annotations

import time

import numpy as np

import kvjax
from kvjax.bench.workloads import multi_turn
from kvjax.memory.tiers import TierConfig


def chat_rounds(tokenizer, *, conversations: int, turns: int, answer_len: int,
                seed: int = 0) -> list[list]:
    """The multi-turn workload as rounds: round k holds every conversation's turn k."""
    requests = multi_turn(tokenizer, seed=seed, num_requests=conversations * turns,
                          num_turns=turns, user_min=16, user_max=32, answer_len=answer_len,
                          think_time_s=0.0)
    by_turn: dict[int, list] = {}
    for r in requests:
        by_turn.setdefault(r.turn, []).append(r)
    return [by_turn[t] for t in sorted(by_turn)]


def tier_config(model: kvjax.Model, rounds: list[list], page_size: int,
                device_fraction: float = 0.5) -> dict:
    """EngineConfig fields: a device pool of `device_fraction` of the final working set (at
    least the longest sequence) and a host tier holding all of it."""
    last = {}
    for batch in rounds:
        for r in batch:
            last[r.conversation_id] = len(r.prompt_ids) + r.max_new_tokens
    total = sum(-(-n // page_size) for n in last.values())
    longest = -(-max(last.values()) // page_size)
    page_bytes = model.config.kv_bytes_per_token(model.dtype) * page_size
    return dict(page_size=page_size, num_pages=max(int(total * device_fraction), longest + 1),
                max_model_len=(longest + 1) * page_size, max_num_seqs=4,
                tiers=TierConfig(host_bytes=(total + 8) * page_bytes))


def host_tier_steps(model: kvjax.Model, rounds: list[list], config: dict, *,
                    is_async: bool) -> dict:
    """Serves `rounds` on one warmed-up engine; host ms per step (steps that did not compile),
    steps, tier-hit tokens and the generated tokens."""
    engine = kvjax.Engine(model, kvjax.EngineConfig(**config, async_scheduling=is_async))
    engine.warmup()
    host, wall, outputs = [], [], {}
    for turn, batch in enumerate(rounds):
        for i, r in enumerate(batch):
            engine.add_request(f"t{turn}-{i}", list(r.prompt_ids), kvjax.SamplingParams(
                max_new_tokens=r.max_new_tokens, ignore_eos=True))
        while engine.has_unfinished():
            before, compiles = engine.stats["host_time_s"], engine.num_compiles
            start = time.perf_counter()
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
            if engine.num_compiles == compiles:
                host.append(engine.stats["host_time_s"] - before)
                wall.append(time.perf_counter() - start)
    stats = engine.stats
    result = dict(steps=stats["steps"], measured_steps=len(host),
                  host_ms_per_step=1e3 * float(np.mean(host)),
                  wall_ms_per_step=1e3 * float(np.mean(wall)),
                  host_fraction_of_wall=float(np.sum(host) / np.sum(wall)),
                  tier_hit_tokens=stats["tier_hit_tokens"],
                  prefill_tokens=stats["prefill_tokens"],
                  tokens=[outputs[k] for k in sorted(outputs)])
    if engine.tiers is not None:
        engine.tiers.close()
    return result
