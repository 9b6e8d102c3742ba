"""KV layer groups at long context: what a sliding-window model holds, and what that buys.

One random-weights model with alternating sliding-window and global layers, and the same model
with every layer global, served at one KV byte budget:

  * bytes held: one sequence of `context` tokens (prompt, then greedy decode) — the pages its
    block tables hold times the bytes of a page, beside `KVCacheSpec.bytes_held` (the spec's
    token-granular prediction) and beside every layer global;
  * capacity: `num_requests` such sequences submitted at once — the most decoding together,
    preemptions, tokens/s after warm-up (prefill and decode; on CPU every layer runs the native
    kernels, a sliding-window layer's reading only its window's pages), and how many
    completed.

Memory numbers come from the allocator, not from a model of it.

`preemption` runs the sliding model under memory pressure instead: `num_requests` sequences
whose prompts fit the budget together but whose decoded lengths do not, once per preemption
mode (recompute, swap, auto: the cost model's choice), each on its own engine, the modes'
measured passes taking turns in one run: tokens/s (fastest pass), preemptions, swaps, bytes
swapped, tokens prefilled again, and whether every mode decodes the recompute run's tokens.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.config import ModelConfig
from kvjax.kv.state import exact_cache_spec
from kvjax.testing import tiny_model


@dataclasses.dataclass(frozen=True)
class Setup:
    """The benchmark's model and load.

    Attributes:
      window: the sliding window of every other layer, in tokens.
      num_layers, hidden_size, num_heads, num_kv_heads, head_dim: the random model's shape.
      context: tokens per sequence (prompt + decoded).
      new_tokens: decoded tokens per sequence.
      num_requests: sequences of the capacity run.
      budget_sequences: the KV budget, in whole sequences of `context` tokens of the
        all-global model.
      page_size, chunk: the engine's page size and prefill chunk.
      pressure_window, pressure_prompt, pressure_new_tokens: the preemption run's window
        (on every other layer), prompt and decoded tokens per sequence; its budget holds
        every sequence at `pressure_prompt + pressure_new_tokens // 2` tokens.
    """

    window: int = 512
    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    context: int = 4096
    new_tokens: int = 32
    num_requests: int = 8
    budget_sequences: int = 2
    page_size: int = 16
    chunk: int = 512
    pressure_window: int = 128
    pressure_prompt: int = 512
    pressure_new_tokens: int = 256


def models(setup: Setup, window: int | None = None) -> dict[str, kvjax.Model]:
    """'sliding' (window on even layers; `setup.window` unless given) and 'global' (no
    window): the same weights."""
    window = setup.window if window is None else window
    base = ModelConfig(vocab_size=512, hidden_size=setup.hidden_size,
                       intermediate_size=2 * setup.hidden_size, num_layers=setup.num_layers,
                       num_heads=setup.num_heads, num_kv_heads=setup.num_kv_heads,
                       head_dim=setup.head_dim, max_position_embeddings=setup.context + 64,
                       eos_token_ids=(511,), name="bench-groups")
    windows = tuple(window if i % 2 == 0 else 0 for i in range(setup.num_layers))
    return {"sliding": tiny_model(dataclasses.replace(base, layer_windows=windows), seed=1),
            "global": tiny_model(base, seed=1)}


def _engine(model: kvjax.Model, setup: Setup, budget: int, **overrides) -> kvjax.Engine:
    return kvjax.Engine(model, kvjax.EngineConfig(**{**dict(
        page_size=setup.page_size, max_model_len=setup.context + setup.page_size,
        max_num_seqs=setup.num_requests, max_prefill_chunk=setup.chunk,
        max_num_batched_tokens=setup.chunk + setup.num_requests, kv_budget_bytes=budget,
        enable_prefix_cache=False), **overrides}))


def _prompts(setup: Setup, n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, setup.context - setup.new_tokens).tolist() for _ in range(n)]


def bytes_held(model: kvjax.Model, setup: Setup, budget: int) -> dict:
    """One sequence decoded to `context` tokens: bytes its tables hold at the end vs the
    spec's prediction."""
    engine = _engine(model, setup, budget)
    greedy = kvjax.SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True)
    engine.add_request("r", _prompts(setup, 1)[0], greedy)
    held_pages = 0
    while engine.has_unfinished():
        engine.step()
        if engine.allocator.has_sequence("r#0"):
            held_pages = engine.allocator.num_held_pages("r#0")
    spec = engine.kv_spec
    held = held_pages * spec.page_bytes
    predicted = spec.bytes_held(setup.context)
    return dict(held_bytes=held, predicted_bytes=predicted, held_over_predicted=held / predicted,
                all_global_bytes=setup.context * spec.bytes_per_token,
                held_over_all_global=held / (setup.context * spec.bytes_per_token),
                groups=spec.describe(), num_table_groups=len(spec.table_groups()))


def capacity(model: kvjax.Model, setup: Setup, budget: int) -> dict:
    """`num_requests` sequences at once at `budget` bytes."""
    engine = _engine(model, setup, budget)
    engine.warmup()  # compiles every step shape first: the run's time is serving only
    greedy = kvjax.SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True)
    for i, prompt in enumerate(_prompts(setup, setup.num_requests)):
        engine.add_request(f"r{i}", prompt, greedy)
    most, steps, done, t0 = 0, 0, 0, time.perf_counter()
    while engine.has_unfinished():
        done += sum(o.finished for o in engine.step())
        steps += 1
        most = max(most, sum(s.num_computed >= s.num_prompt_tokens
                             for s in engine.scheduler.running))
    seconds = time.perf_counter() - t0
    return dict(num_pages=engine.num_pages, page_bytes=engine.kv_bytes_per_page,
                most_decoding_together=most, preemptions=engine.stats["preemptions"],
                completed=done, steps=steps, seconds=seconds,
                tokens_per_s=setup.num_requests * setup.context / seconds)


def run(setup: Setup) -> dict:
    """Both models at one budget: `budget_sequences` whole sequences of the all-global model."""
    built = models(setup)
    budget = int(setup.budget_sequences * setup.context
                 * built["global"].config.kv_bytes_per_token("float32"))
    out = dict(setup=dataclasses.asdict(setup), budget_bytes=budget)
    for name, model in built.items():
        out[name] = dict(bytes_held=bytes_held(model, setup, budget),
                         capacity=capacity(model, setup, budget))
    return out


_PREEMPTION_MODES = (kvjax.PreemptionMode.RECOMPUTE, kvjax.PreemptionMode.SWAP,
                     kvjax.PreemptionMode.AUTO)
_COUNTERS = ("preemptions", "swaps_out", "swap_bytes", "prefill_tokens")


def _pressure_pass(engine: kvjax.Engine, prompts: list[list[int]], setup: Setup) -> dict:
    """One pass of the load: its seconds, counters and tokens."""
    greedy = kvjax.SamplingParams(max_new_tokens=setup.pressure_new_tokens, ignore_eos=True)
    before = {k: engine.stats[k] for k in _COUNTERS}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, greedy)
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, tokens=[o.outputs[0].token_ids for o in outs],
                **{k: engine.stats[k] - before[k] for k in _COUNTERS})


def preemption(setup: Setup, repeats: int = 3) -> dict:
    """The sliding model (window `pressure_window`) under memory pressure, one engine per
    preemption mode: each serves the load once to compile what it uses, then `repeats` times,
    the modes taking turns (so a load on the machine falls on all alike); the fastest pass of
    each is reported. Tokens are compared with the recompute engine's."""
    model = models(setup, setup.pressure_window)["sliding"]
    spec = exact_cache_spec(model.config, setup.page_size, jnp.float32)
    budget = int(setup.num_requests * spec.bytes_held(
        setup.pressure_prompt + setup.pressure_new_tokens // 2))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 500, setup.pressure_prompt).tolist()
               for _ in range(setup.num_requests)]
    engines = {mode.value: _engine(model, setup, budget, preemption_mode=mode,
                                   max_model_len=setup.pressure_prompt
                                   + setup.pressure_new_tokens + setup.page_size)
               for mode in _PREEMPTION_MODES}
    for engine in engines.values():
        _pressure_pass(engine, prompts, setup)
    passes = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            passes[name].append(_pressure_pass(engine, prompts, setup))
    reference = passes["recompute"][0]["tokens"]
    runs = {}
    for name, measured in passes.items():
        best = min(measured, key=lambda m: m["seconds"])
        runs[name] = dict(
            num_pages=engines[name].num_pages, seconds=best["seconds"],
            pass_seconds=[m["seconds"] for m in measured],
            tokens_per_s=setup.num_requests * setup.pressure_new_tokens / best["seconds"],
            preemptions=best["preemptions"], swaps_out=best["swaps_out"],
            swap_bytes=best["swap_bytes"],
            prefilled_again=best["prefill_tokens"] - len(prompts) * setup.pressure_prompt,
            same_tokens_as_recompute=all(m["tokens"] == reference for m in measured))
    for run_ in runs.values():
        run_["tokens_per_s_over_recompute"] = (run_["tokens_per_s"]
                                               / runs["recompute"]["tokens_per_s"])
    return dict(setup=dataclasses.asdict(setup), budget_bytes=budget, repeats=repeats,
                spec_bytes_per_sequence_at_end=spec.bytes_held(
                    setup.pressure_prompt + setup.pressure_new_tokens),
                modes=runs)


PREEMPTION_COLUMNS = (("pool_pages", "pool pages", "{:d}"),
                      ("preemptions", "preemptions", "{:d}"), ("swaps", "swaps", "{:d}"),
                      ("swap_MiB", "swapped (MiB, out + in)", "{:.1f}"),
                      ("prefilled_again", "tokens prefilled again", "{:d}"),
                      ("tok_per_s", "decoded tokens/s", "{:.1f}"),
                      ("vs_recompute", "tokens/s vs recompute", "{:.2f}"),
                      ("same", "tokens = recompute's", "{}"))


def preemption_rows(result: dict) -> dict[str, dict]:
    """One table row per preemption mode (`PREEMPTION_COLUMNS`)."""
    return {name: dict(pool_pages=r["num_pages"], preemptions=r["preemptions"],
                       swaps=r["swaps_out"], swap_MiB=r["swap_bytes"] / 2**20,
                       prefilled_again=r["prefilled_again"], tok_per_s=r["tokens_per_s"],
                       vs_recompute=r["tokens_per_s_over_recompute"],
                       same=r["same_tokens_as_recompute"])
            for name, r in result["modes"].items()}


COLUMNS = (("held_MiB", "KV held (MiB)", "{:.2f}"), ("held_vs_spec", "held / spec", "{:.3f}"),
           ("held_vs_all_global", "held / all global", "{:.3f}"),
           ("pool_pages", "pool pages", "{:d}"),
           ("decoding_together", "decoding at once", "{:d}"),
           ("preemptions", "preemptions", "{:d}"), ("completed", "completed", "{:d}"),
           ("tok_per_s", "tokens/s", "{:.0f}"))


def rows(result: dict) -> dict[str, dict]:
    """One table row per model (`COLUMNS`)."""
    return {name: dict(held_MiB=r["bytes_held"]["held_bytes"] / 2**20,
                       held_vs_spec=r["bytes_held"]["held_over_predicted"],
                       held_vs_all_global=r["bytes_held"]["held_over_all_global"],
                       pool_pages=r["capacity"]["num_pages"],
                       decoding_together=r["capacity"]["most_decoding_together"],
                       preemptions=r["capacity"]["preemptions"],
                       completed=r["capacity"]["completed"],
                       tok_per_s=r["capacity"]["tokens_per_s"])
            for name, r in result.items() if name in ("sliding", "global")}
