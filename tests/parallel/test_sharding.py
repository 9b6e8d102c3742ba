"""Tensor-parallel engines on 8 fake CPU devices give the single-device engine's greedy tokens.

The sharded runs need XLA_FLAGS set before jax is imported, and the test session has imported
jax already, so they run in a child process: this file run as a script (`python
test_sharding.py <case>`) prints one JSON object of results that the tests below check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MAX_NEW = 8




def _gqa3_config():
    """The embedded model's head counts (9 query heads, 3 kv heads) at test size."""
    from kvjax.config import ModelConfig

    return ModelConfig(vocab_size=128, hidden_size=36, intermediate_size=48, num_layers=2,
                       num_heads=9, num_kv_heads=3, head_dim=8, max_position_embeddings=256,
                       eos_token_ids=(127,), name="tiny-gqa3")


def _qwen3_config():
    """Qwen3's layer shape (per-head Q/K RMSNorm, N*D != H) with a YaRN RoPE, at test size."""
    from kvjax.config import ModelConfig
    from kvjax.models.rope import RoPE, RopeType

    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                       qk_norm=True, rope=RoPE(RopeType.YARN, theta=1e6, factor=4.0,
                                               original_max_position_embeddings=16,
                                               attention_factor=1.1),
                       eos_token_ids=(127,), name="tiny-qwen3")


def _gemma_config():
    """Every Gemma field on (Gemma 2's soft caps with Gemma 3's Q/K norms and local RoPE), at
    test size: GeGLU, (1 + w) sandwich norms, scaled embeddings, a query scale apart from D."""
    from kvjax.config import MlpActivation, ModelConfig
    from kvjax.models.rope import RoPE, RopeType

    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                       qk_norm=True, activation=MlpActivation.GELU_TANH, norm_unit_offset=True,
                       scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=24,
                       attn_logit_softcap=3.0, final_logit_softcap=8.0,
                       rope=RoPE(RopeType.LINEAR, theta=1e6, factor=4.0),
                       local_rope=RoPE(theta=100.0), local_rope_layers=(0, 2),
                       eos_token_ids=(127,), name="tiny-gemma")


def _moe_config():
    """A mixture of experts with a dense first layer and a gated shared expert, at test size:
    the dense MLP splits over tp, the experts are replicated."""
    from kvjax.testing import TINY_MOE

    return dataclasses.replace(TINY_MOE, moe=dataclasses.replace(
        TINY_MOE.moe, dense_layers=(0,), shared_size=16, shared_gate=True))


def _prompts(seed: int = 0, count: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(0, 120, size=9)]
    return [(shared if i % 2 else []) + [int(t) for t in rng.integers(0, 120, size=int(
        rng.integers(2, 14)))] for i in range(count)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# Every prompt prefills in the first step: two step shapes per engine keep compiles few. (With
# the prefix cache on, a prompt whose prefix another prompt is computing waits a step for the
# hit, and the staggered steps take six shapes; prefix hits on a mesh are the composed case's.)
_CONFIG = dict(page_size=4, num_pages=96, max_num_batched_tokens=256, max_prefill_chunk=32,
               min_chunk_bucket=32, max_num_seqs=8, max_prefill_seqs=8, enable_prefix_cache=False)


def _single_and_tensor_parallel(cases) -> dict:
    """For each (name, model, tp): the greedy tokens of a single-device engine and of one on a
    tp mesh, and how the tp engine laid out its KV and weights."""
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.parallel import sharding

    config, sampling = EngineConfig(**_CONFIG), SamplingParams(max_new_tokens=MAX_NEW)
    prompts = _prompts()
    results = {}
    for name, model, tp in cases:
        single = Engine(model, config)
        results[f"{name}_single"] = _tokens(single.generate(prompts, sampling))
        mesh = sharding.replica_meshes(sharding.make_mesh(tp))[0]
        engine = Engine(model, config, mesh=mesh)
        results[f"{name}_tp{tp}"] = _tokens(engine.generate(prompts, sampling))
        shard = engine.kv.k_pages.addressable_shards[0].data
        results[f"{name}_tp{tp}_kv"] = dict(
            spec=list(engine.kv.k_pages.sharding.spec), shard_shape=list(shard.shape),
            wq_shard=list(engine.model.params["layers"]["wq"].addressable_shards[0]
                          .data.shape),
            compiles=engine.num_compiles, single_compiles=single.num_compiles,
            used_pages=engine.allocator.num_used_pages())
    return results


def _run_architecture_cases() -> dict:
    """Qwen3's and Gemma's layer shapes on tp=2 meshes (the slow tier's cases)."""
    from kvjax.testing import tiny_model

    return _single_and_tensor_parallel((("qwen3", tiny_model(_qwen3_config()), 2),
                                        ("gemma", tiny_model(_gemma_config()), 2)))


def _run_fast_cases() -> dict:
    import jax

    from kvjax import EngineConfig, PreemptionMode, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.parallel import sharding
    from kvjax.router import DisaggregatedEngine, Router
    from kvjax.testing import tiny_model

    config, sampling = EngineConfig(**_CONFIG), SamplingParams(max_new_tokens=MAX_NEW)
    prompts = _prompts()
    results = _single_and_tensor_parallel(
        (("gqa3", tiny_model(_gqa3_config()), 3), ("tiny", tiny_model(), 2)))
    # Composed KV behaviours on a mesh: int8 pages, h2o retention, prefix-cache hits and swap
    # preemption under memory pressure give the tokens of the same engine on one device.
    model = tiny_model()
    # (Two rows a step keep the step shapes few; seven pages still swap several times.)
    composed = dataclasses.replace(config, num_pages=7, max_num_seqs=2, max_prefill_seqs=2,
                                   kv_codec="int8", retention="h2o", enable_prefix_cache=True,
                                   retention_budget=12, retention_options=dict(num_recent=4),
                                   preemption_mode=PreemptionMode.SWAP)
    for size in (1, 2):
        mesh = sharding.replica_meshes(sharding.make_mesh(size))[0] if size > 1 else None
        engine = Engine(model, composed, mesh=mesh)
        results[f"composed_tp{size}"] = _tokens(engine.generate(prompts, sampling))
        results[f"composed_tp{size}_stats"] = dict(
            swaps_out=engine.stats["swaps_out"], evictions=engine.retention.stats["evictions"],
            prefix_hit_tokens=engine.metrics()["prefix_hit_tokens"],
            used_pages=engine.allocator.num_used_pages())
    # dp=2 x tp=2: two engine replicas on disjoint device pairs behind a router.
    meshes = sharding.replica_meshes(sharding.make_mesh(2, dp=2))
    router = Router([Engine(model, config, mesh=m) for m in meshes], "least_loaded")
    results["dp2tp2"] = _tokens(router.generate(prompts, sampling))
    results["dp2tp2_devices"] = [sorted(d.id for d in e.kv.k_pages.sharding.device_set)
                                 for e in router.engines]
    results["dp2tp2_routed"] = sorted(set(router.routed_to.values()))
    # Disaggregation between meshes: prefill tp=2 on devices 4-5, decode on device 6 alone.
    devices = jax.devices()
    prefill_mesh = sharding.replica_meshes(sharding.make_mesh(2, devices=devices[4:6]))[0]
    decode_mesh = sharding.replica_meshes(sharding.make_mesh(1, devices=devices[6:7]))[0]
    paged = dataclasses.replace(config, enable_prefix_cache=True)  # what KV transfer needs
    disagg = DisaggregatedEngine(Engine(model, paged, mesh=prefill_mesh),
                                 Engine(model, paged, mesh=decode_mesh))
    results["disagg_cross_mesh"] = _tokens(disagg.generate(prompts, sampling))
    results["disagg_bytes"] = disagg.stats["transfer_bytes"]
    return results


def _run_moe_case() -> dict:
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.parallel import sharding
    from kvjax.testing import tiny_model

    config, sampling = EngineConfig(**_CONFIG), SamplingParams(max_new_tokens=MAX_NEW)
    model, prompts = tiny_model(_moe_config()), _prompts()
    mesh = sharding.replica_meshes(sharding.make_mesh(2))[0]
    engine = Engine(model, config, mesh=mesh)
    return dict(single=_tokens(Engine(model, config).generate(prompts, sampling)),
                tp2=_tokens(engine.generate(prompts, sampling)),
                used_pages=engine.allocator.num_used_pages())


def _run_embedded_case() -> dict:
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.models.loading import load_model
    from kvjax.parallel import sharding

    model = load_model(None, "float32")
    prompt = model.tokenizer.encode("The capital of France is")
    config = EngineConfig(page_size=16, num_pages=8, max_num_seqs=1)
    sampling = SamplingParams(max_new_tokens=6)
    single = _tokens(Engine(model, config).generate([prompt], sampling))
    mesh = sharding.replica_meshes(sharding.make_mesh(3))[0]
    return dict(single=single, tp3=_tokens(Engine(model, config, mesh=mesh).generate(
        [prompt], sampling)))


def _run_pallas_case() -> dict:
    """attention_impl=pallas on tp meshes (each kernel under shard_map on its device's heads,
    interpreted on the CPU) against the jnp reference on one device: exact pages, int8 pages
    (the quantized decode kernel), Quest's narrowed reads, and 3 kv heads over tp=3."""
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine
    from kvjax.parallel import sharding
    from kvjax.testing import tiny_model

    config = EngineConfig(page_size=4, num_pages=48, max_num_batched_tokens=64,
                          max_prefill_chunk=16, min_chunk_bucket=16, max_num_seqs=4,
                          max_prefill_seqs=4)
    sampling = SamplingParams(max_new_tokens=4)
    prompts = _prompts(count=3)
    results = {}
    for name, model, tp, overrides in (
            ("none", tiny_model(), 2, {}), ("int8", tiny_model(), 2, dict(kv_codec="int8")),
            ("quest", tiny_model(), 2, dict(retention="quest", retention_budget=8)),
            ("gqa3", tiny_model(_gqa3_config()), 3, {})):
        reference = dataclasses.replace(config, **overrides)
        pallas = dataclasses.replace(reference, attention_impl="pallas")
        mesh = sharding.replica_meshes(sharding.make_mesh(tp))[0]
        results[name] = dict(
            reference=_tokens(Engine(model, reference).generate(prompts, sampling)),
            pallas_tp=_tokens(Engine(model, pallas, mesh=mesh).generate(prompts, sampling)))
    return results


def _child(case: str) -> dict:
    flags = "--xla_force_host_platform_device_count=8"
    if case == "fast":
        # Its many small programs compile about a third faster with the CPU code generator's
        # optimizations off. Code generation follows the mesh partitioning these cases check,
        # and every result of the case is the same either way.
        flags += " --xla_backend_optimization_level=0"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, case], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded():
    return _child("fast")


@pytest.fixture(scope="module")
def sharded_architectures():
    return _child("architectures")


@pytest.mark.parametrize("name,tp", [("gqa3", 3), ("tiny", 2)])
def test_tensor_parallel_greedy_tokens_match_single_device(sharded, name, tp):
    assert sharded[f"{name}_tp{tp}"] == sharded[f"{name}_single"]
    assert sharded[f"{name}_tp{tp}_kv"]["used_pages"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_tensor_parallel_architectures_match_single_device(sharded_architectures, name):
    """Per-head Q/K norms, YaRN, soft caps, sandwich norms and local RoPE under tp=2: the
    same split as the cases above with other layer shapes."""
    assert sharded_architectures[f"{name}_tp2"] == sharded_architectures[f"{name}_single"]
    assert sharded_architectures[f"{name}_tp2_kv"]["used_pages"] == 0


@pytest.mark.slow
def test_moe_on_a_tp2_mesh_matches_single_device():
    """A mixture of experts with a dense layer and a gated shared expert: its experts are
    replicated, its attention and dense MLP split over the mesh."""
    result = _child("moe")
    assert result["tp2"] == result["single"]
    assert result["used_pages"] == 0


@pytest.mark.parametrize("name,tp,kv_heads,q_cols", [("gqa3", 3, 1, 3 * 8), ("tiny", 2, 1, 2 * 8)])
def test_kv_pages_and_heads_stay_split_across_steps(sharded, name, tp, kv_heads, q_cols):
    info = sharded[f"{name}_tp{tp}_kv"]
    assert info["spec"] == [None, None, None, "tp"]
    assert info["shard_shape"][3] == kv_heads  # K / tp whole kv heads per device
    assert info["wq_shard"][2] == q_cols  # N / tp whole query heads (x D columns) per device
    # The donated KV keeps its layout, so steps never recompile beyond the single-device count.
    assert info["compiles"] == info["single_compiles"]


def test_quantized_retained_swapped_kv_on_a_mesh_matches_one_device(sharded):
    assert sharded["composed_tp2"] == sharded["composed_tp1"]
    stats = sharded["composed_tp2_stats"]
    assert stats["swaps_out"] > 0 and stats["evictions"] > 0, stats
    assert stats["prefix_hit_tokens"] > 0, stats
    assert stats["used_pages"] == 0


def test_data_parallel_replicas_of_tensor_parallel_engines(sharded):
    assert sharded["dp2tp2"] == sharded["tiny_single"]
    assert sharded["dp2tp2_devices"] == [[0, 1], [2, 3]]
    assert sharded["dp2tp2_routed"] == [0, 1]


def test_disaggregation_between_meshes_moves_kv_and_keeps_tokens(sharded):
    assert sharded["disagg_cross_mesh"] == sharded["tiny_single"]
    assert sharded["disagg_bytes"] > 0


@pytest.mark.slow
def test_embedded_model_tp3_matches_single_device():
    result = _child("embedded")
    assert result["tp3"] == result["single"]


@pytest.mark.slow
def test_pallas_kernels_on_a_mesh_match_the_reference_on_one_device():
    results = _child("pallas")
    for name, result in results.items():
        assert result["pallas_tp"] == result["reference"], name


def test_indivisible_heads_raise_value_error():
    from kvjax.parallel.sharding import check_tensor_parallel
    from kvjax.testing import TINY

    with pytest.raises(ValueError, match="num_heads=9"):
        check_tensor_parallel(_gqa3_config(), 2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_tensor_parallel(TINY, 4)  # 4 query heads divide, 2 kv heads do not
    check_tensor_parallel(_gqa3_config(), 3)


def test_indivisible_mlp_width_raises_value_error():
    import dataclasses

    from kvjax.parallel.sharding import check_tensor_parallel

    config = dataclasses.replace(_gqa3_config(), intermediate_size=50)
    with pytest.raises(ValueError, match="intermediate_size=50"):
        check_tensor_parallel(config, 3)


def test_param_specs_split_heads_and_mlp_and_replicate_the_rest():
    from kvjax.parallel.sharding import param_specs
    from kvjax.testing import tiny_model

    specs = param_specs(tiny_model().params)
    layers = specs["layers"]
    assert layers["wq"] == layers["wk"] == layers["wv"] == P(None, None, "tp")
    assert layers["wo"] == layers["w_down"] == P(None, "tp", None)
    assert layers["w_gate"] == layers["w_up"] == P(None, None, "tp")
    assert specs["embed"] == specs["final_norm"] == layers["attn_norm"] == P()


def test_engine_mesh_validation():
    import jax
    from jax.sharding import Mesh

    from kvjax import EngineConfig
    from kvjax.engine.engine import Engine
    from kvjax.parallel.sharding import make_mesh
    from kvjax.testing import tiny_model

    with pytest.raises(ValueError, match="needs 1024 devices"):
        make_mesh(tp=1024)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="'tp' axis"):
        Engine(tiny_model(), EngineConfig(num_pages=8), mesh=mesh)


if __name__ == "__main__":
    # XLA_FLAGS came with the environment (see _child).
    case = sys.argv[1]
    runs = dict(fast=_run_fast_cases, architectures=_run_architecture_cases,
                embedded=_run_embedded_case, pallas=_run_pallas_case, moe=_run_moe_case)
    print(json.dumps(runs[case]()))
