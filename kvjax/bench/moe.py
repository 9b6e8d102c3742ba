"""Decode and prefill step time of a mixture-of-experts model against dense models of its active
and of its total MLP size.

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
active experts' weights); a larger one runs every expert or groups the rows by expert
(`kvjax.models.moe.default_method`).

Prefill: each model's engine prefills one prompt of `prefill_tokens` tokens in one chunk (the
MoE's experts run grouped), timed from submission to its first token; and one layer's
MLP alone, jitted, on as many random rows: the MoE grouped, the MoE running every expert
(`ExpertsMethod.ALL`, the method large steps ran before the grouped one) and the dense SwiGLU
of the active size.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.config import ModelConfig, MoeConfig
from kvjax.models import llama
from kvjax.models import moe as moe_lib
from kvjax.testing import tiny_model


@dataclasses.dataclass(frozen=True)
class Setup:
    """The models and the load.

    Attributes:
      num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size: the shared shape.
      num_experts, num_experts_per_tok, expert_size: the MoE's MLP.
      batches: sequences decoding together, one measurement each.
      prompt_len, new_tokens: tokens per sequence.
      prefill_tokens: prompt lengths prefilled in one chunk, one measurement each.
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
    prefill_tokens: tuple[int, ...] = (256, 1024)
    repeats: int = 3


def models(setup: Setup) -> dict[str, kvjax.Model]:
    """'moe', 'dense_active' and 'dense_total' (random weights, the same seed)."""
    s = setup
    base = ModelConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                       intermediate_size=s.num_experts_per_tok * s.expert_size,
                       num_layers=s.num_layers, num_heads=s.num_heads,
                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                       max_position_embeddings=max(s.prompt_len + s.new_tokens,
                                                   *s.prefill_tokens) + 64,
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


def _prefill_engine(model: kvjax.Model, setup: Setup, num_tokens: int) -> kvjax.Engine:
    return kvjax.Engine(model, kvjax.EngineConfig(
        page_size=16, max_model_len=num_tokens + 16, max_num_seqs=1,
        max_prefill_chunk=num_tokens, max_num_batched_tokens=num_tokens,
        enable_prefix_cache=False))


def _prefill_times(engine: kvjax.Engine, setup: Setup, num_tokens: int, seed: int
                   ) -> list[float]:
    """Wall seconds from submitting a `num_tokens` prompt to its first token: the prefill
    chunk's step (the engine's steps return before the device finishes, so steps are not timed
    one by one here)."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    engine.add_request(f"p{seed}", rng.integers(0, setup.vocab_size - 1, num_tokens).tolist(),
                       kvjax.SamplingParams(max_new_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [time.perf_counter() - t0]


def _layer_mlps(built: dict[str, kvjax.Model]) -> dict[str, object]:
    """name -> jitted f(x [T, H]) -> [T, H]: layer 0's MLP of the MoE (grouped, every expert)
    and of `dense_active`."""
    moe_model, dense = built["moe"], built["dense_active"]
    moe_p = {name: w[0] for name, w in moe_model.params["layers"].items()}
    dense_p = {name: w[0] for name, w in dense.params["layers"].items()}
    m = moe_model.config.moe

    def routed(method):
        def f(x):
            weights, experts = moe_lib.route(m, x @ moe_p["router"])
            return moe_lib.routed_experts(m, moe_p, x, weights, experts, method=method)
        return jax.jit(f)

    return {"moe grouped": routed(moe_lib.ExpertsMethod.GROUPED),
            "moe all experts": routed(moe_lib.ExpertsMethod.ALL),
            "dense_active": jax.jit(lambda x: llama.dense_mlp(dense.config, dense_p, x))}


def _layer_times(fn, x: jax.Array) -> float:
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    return time.perf_counter() - t0


def run(setup: Setup) -> dict:
    """Median decode and prefill step seconds per model and batch, the models taking turns."""
    built = models(setup)
    out: dict = dict(setup=dataclasses.asdict(setup), params={
        name: sum(int(np.prod(w.shape)) for w in _mlp_leaves(m)) for name, m in built.items()})
    for batch in setup.batches:
        engines = {name: _engine(m, setup, batch) for name, m in built.items()}
        out[f"batch{batch}"] = _medians(engines, lambda e, seed, b=batch: _decode_step_times(
            e, setup, b, seed), setup.repeats)
        _name_methods(out[f"batch{batch}"], built["moe"], batch)
    layer_fns = _layer_mlps(built)
    for num_tokens in setup.prefill_tokens:
        engines = {name: _prefill_engine(m, setup, num_tokens) for name, m in built.items()}
        out[f"prefill{num_tokens}"] = _medians(engines, lambda e, seed, n=num_tokens: (
            _prefill_times(e, setup, n, seed)), setup.repeats)
        _name_methods(out[f"prefill{num_tokens}"], built["moe"], num_tokens)
        x = jnp.asarray(np.random.default_rng(0).standard_normal(
            (num_tokens, setup.hidden_size)), jnp.float32)
        out[f"layer{num_tokens}"] = _medians(layer_fns, lambda fn, seed, x=x: [
            _layer_times(fn, x)], 5 * setup.repeats)
    return out


def _name_methods(per_model: dict[str, dict], moe_model: kvjax.Model, num_tokens: int) -> None:
    """Adds each row's experts method: the MoE's for steps of `num_tokens` tokens, '' else."""
    method = moe_lib.default_method(moe_model.config.moe, num_tokens).value
    for name, r in per_model.items():
        r["experts"] = method if name == "moe" else ""


def _medians(runners: dict, measure, repeats: int) -> dict[str, dict]:
    """name -> median seconds of `measure(runner, seed)` over `repeats` turns after a warm-up
    turn (every shape compiles there), with the ratio to 'dense_active'."""
    for runner in runners.values():
        measure(runner, 0)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(repeats):
        for name, runner in runners.items():
            times[name] += measure(runner, rep + 1)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    return {name: dict(median_step_s=medians[name], steps=len(times[name]),
                       vs_dense_active=medians[name] / medians["dense_active"])
            for name in runners}


def _mlp_leaves(model: kvjax.Model) -> list:
    layers = model.params["layers"]
    return [w for name, w in layers.items() if name.startswith("w_") or name == "router"]


COLUMNS = (("mlp_params", "MLP params (M)", "{:.2f}"), ("step_ms", "step (ms)", "{:.2f}"),
           ("ratio", "vs dense_active", "{:.2f}"))

_ROW_KINDS = (("batch", "decode step, batch"), ("prefill", "prefill to first token, tokens"),
              ("layer", "one layer's MLP, tokens"))


def rows(result: dict) -> dict[str, dict]:
    """One table row per (measurement, model)."""
    out = {}
    for key, per_model in result.items():
        kind = next(((p, label) for p, label in _ROW_KINDS if key.startswith(p)
                     and key[len(p):].isdigit()), None)
        if kind is None:
            continue
        for name, r in per_model.items():
            experts = f" ({r['experts']})" if r.get("experts") else ""
            label = f"{kind[1]} {key[len(kind[0]):]}: {name}{experts}"
            out[label] = dict(mlp_params=result["params"].get(name.split()[0], 0.0) / 1e6,
                              step_ms=1e3 * r["median_step_s"], ratio=r["vs_dense_active"])
    return out
