"""Decode step time of a mixture-of-experts model against dense models of its active and of its
total MLP size.

Three random-weights models share attention, embeddings and layer count; they differ in the MLP:

  * `moe`: `num_experts` SwiGLU experts of `expert_size`, `num_experts_per_tok` per token
    (Mixtral's routing);
  * `dense_active`: one SwiGLU of `num_experts_per_tok * expert_size`, the MoE's active MLP
    parameters per token;
  * `dense_total`: one SwiGLU of `num_experts * expert_size`, all of the MoE's MLP parameters.

Each serves `batch` sequences through the engine; once every sequence is decoding, each engine
step's wall time is recorded. The models take turns, `repeats` rounds each, so a noisy machine
slows them alike; the table gives median step times and their ratio to `dense_active`. A step of
`batch * num_experts_per_tok <= num_experts` tokens gathers each token's experts (it reads the
active experts' weights); a larger one runs every expert (`kvjax.models.moe`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import kvjax
from kvjax.config import ModelConfig, MoeConfig
from kvjax.testing import tiny_model


@dataclasses.dataclass(frozen=True)
class Setup:
    """The models and the load.

    Attributes:
      num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size: the shared shape.
      num_experts, num_experts_per_tok, expert_size: the MoE's MLP.
      batches: sequences decoding together, one measurement each.
      prompt_len, new_tokens: tokens per sequence.
      repeats: rounds per model and batch (the models take turns).
    """

    num_layers: int = 4
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 2048
    num_experts: int = 8
    num_experts_per_tok: int = 2
    expert_size: int = 512
    batches: tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 16
    new_tokens: int = 32
    repeats: int = 3


def models(setup: Setup) -> dict[str, kvjax.Model]:
    """'moe', 'dense_active' and 'dense_total' (random weights, the same seed)."""
    s = setup
    base = ModelConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                       intermediate_size=s.num_experts_per_tok * s.expert_size,
                       num_layers=s.num_layers, num_heads=s.num_heads,
                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                       max_position_embeddings=s.prompt_len + s.new_tokens + 64,
                       eos_token_ids=(s.vocab_size - 1,), name="bench-moe")
    moe = MoeConfig(num_experts=s.num_experts, num_experts_per_tok=s.num_experts_per_tok,
                    expert_size=s.expert_size)
    return {"moe": tiny_model(dataclasses.replace(base, moe=moe), seed=1, scale=0.05),
            "dense_active": tiny_model(base, seed=1, scale=0.05),
            "dense_total": tiny_model(dataclasses.replace(
                base, intermediate_size=s.num_experts * s.expert_size), seed=1, scale=0.05)}


def _engine(model: kvjax.Model, setup: Setup, batch: int) -> kvjax.Engine:
    return kvjax.Engine(model, kvjax.EngineConfig(
        page_size=16, max_model_len=setup.prompt_len + setup.new_tokens + 16,
        max_num_seqs=batch, max_prefill_chunk=setup.prompt_len * batch,
        max_num_batched_tokens=setup.prompt_len * batch, enable_prefix_cache=False))


def _decode_step_times(engine: kvjax.Engine, setup: Setup, batch: int, seed: int
                       ) -> list[float]:
    """Wall seconds of each step in which all `batch` sequences decode."""
    rng = np.random.default_rng(seed)
    greedy = kvjax.SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{seed}-{i}", rng.integers(0, setup.vocab_size - 1,
                                                        setup.prompt_len).tolist(), greedy)
    times = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        decoding = len(running) == batch and all(
            s.num_computed >= s.num_prompt_tokens for s in running)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return times


def run(setup: Setup) -> dict:
    """Median decode step seconds per model and batch, the models taking turns."""
    built = models(setup)
    out: dict = dict(setup=dataclasses.asdict(setup), params={
        name: sum(int(np.prod(w.shape)) for w in _mlp_leaves(m)) for name, m in built.items()})
    for batch in setup.batches:
        engines = {name: _engine(m, setup, batch) for name, m in built.items()}
        for engine in engines.values():  # warm-up: every step shape compiles here
            _decode_step_times(engine, setup, batch, seed=0)
        times: dict[str, list[float]] = {name: [] for name in built}
        for rep in range(setup.repeats):
            for name, engine in engines.items():
                times[name] += _decode_step_times(engine, setup, batch, seed=rep + 1)
        medians = {name: float(np.median(t)) for name, t in times.items()}
        out[f"batch{batch}"] = {name: dict(
            median_step_s=medians[name], steps=len(times[name]),
            vs_dense_active=medians[name] / medians["dense_active"],
            gathers_experts=(name == "moe"
                             and batch * setup.num_experts_per_tok <= setup.num_experts))
            for name in built}
    return out


def _mlp_leaves(model: kvjax.Model) -> list:
    layers = model.params["layers"]
    return [w for name, w in layers.items() if name.startswith("w_") or name == "router"]


COLUMNS = (("mlp_params", "MLP params (M)", "{:.2f}"), ("step_ms", "decode step (ms)", "{:.2f}"),
           ("ratio", "vs dense_active", "{:.2f}"))


def rows(result: dict) -> dict[str, dict]:
    """One table row per (batch, model)."""
    out = {}
    for key, per_model in result.items():
        if not key.startswith("batch"):
            continue
        for name, r in per_model.items():
            label = f"{name}, batch {key[5:]}" + (" (gathered)" if r["gathers_experts"] else "")
            out[label] = dict(mlp_params=result["params"][name] / 1e6,
                              step_ms=1e3 * r["median_step_s"], ratio=r["vs_dense_active"])
    return out
