"""Every Pallas kernel and the engine step compile for H100, A100, TPU v5e and v6e, or the
dispatch refuses them with their reason.

A compile is the check: Triton -> PTX -> ptxas for the GPUs (shared memory, registers), Mosaic
inside libtpu for the TPUs (vector layouts). Each compiled case must also show its Pallas
kernels as the target's own kernels (Triton launches with their shared memory on GPU, Mosaic
custom calls on TPU), so a case that fell back to the interpreter or the jnp reference fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kvjax.bench import deviceless as dl
from kvjax.kv import codecs
from pallas_kernels import targets
from pallas_kernels.paged_decode.kernel import gpu_block_tokens
from pallas_kernels.quantized_decode.kernel import quantized_decode_attention

# (program prefix, target) -> a phrase of the refusal the dispatch gives.
EXPECTED_REFUSALS = {
    ("quantized_decode_fp8", "a100"): "compute capability 8.9",
}


def _expected_refusal(case: dl.Case) -> str | None:
    for (prefix, target), phrase in EXPECTED_REFUSALS.items():
        if case.program.startswith(prefix) and case.target == target:
            return phrase
    return None


@pytest.mark.parametrize("case", dl.all_cases(), ids=lambda c: c.id)
def test_compiles_or_is_refused(case):
    record = dl.compile_case(case)
    phrase = _expected_refusal(case)
    if phrase is not None:
        assert record["status"] == "refused", record
        assert phrase in record["reason"]
        return
    assert record["status"] == "compiled", record.get("reason")
    if dl.TARGETS[case.target].platform == "cuda":
        kernels = record["kernels"]
        assert kernels, "no Pallas kernel was compiled by Triton"
        budget = dl.TARGETS[case.target].gpu.shared_memory_per_block
        assert all(0 < k["shared_memory"] <= budget for k in kernels), kernels
    else:
        assert record["mosaic_calls"] > 0, "no Pallas kernel was compiled by Mosaic"


@pytest.mark.parametrize("case", [dl.Case(p, t, "bfloat16", "smollm2") for t in dl.TARGETS
                                  for p in dl.WINDOWED], ids=lambda c: c.id)
def test_kernels_with_a_traced_window_compile(case):
    """The engine passes each layer's window as a traced scalar (0: global): the float-page
    kernels take it as a per-row input and still compile as the target's own kernels."""
    check_compiled_as_target_kernel(case)


def check_compiled_as_target_kernel(case: dl.Case) -> None:
    record = dl.compile_case(case)
    assert record["status"] == "compiled", record.get("reason")
    if dl.TARGETS[case.target].platform == "cuda":
        assert record["kernels"], "no Pallas kernel was compiled by Triton"
    else:
        assert record["mosaic_calls"] > 0, "no Pallas kernel was compiled by Mosaic"


@pytest.mark.parametrize("case", [dl.Case(p, t, "bfloat16", "smollm2") for t in ("h100", "v5e")
                                  for p in dl.GROUPED], ids=lambda c: c.id)
def test_grouped_int8_kernel_compiles(case):
    """int8 with a scale and zero per channel group (`kv_codec_options={"group": 32}`) is read
    by the quantized kernel as the target's own kernel, not the reference attention."""
    check_compiled_as_target_kernel(case)


def test_fp8_kernel_refuses_sm80_before_the_compiler():
    """Called directly (not through the dispatch), the kernel raises instead of letting LLVM
    abort the process on an A100."""
    codec = codecs.get_codec("fp8_e4m3", scaling="dynamic")
    k, d, pages = 3, 64, 8
    spec = codec.storage_spec(pages * dl.PAGE_SIZE, k, d)
    stored = {n: jnp.zeros((pages, dl.PAGE_SIZE) + s.shape[1:], s.dtype)
              for n, s in spec.items()}
    q = jnp.zeros((2, 9, d), jnp.bfloat16)
    tables, lens = jnp.zeros((2, 4), jnp.int32), jnp.ones(2, jnp.int32)
    mesh = dl.target_mesh("a100")
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert targets.current_gpu().name == "A100"
        with pytest.raises(ValueError, match="compute capability 8.9.*sm_80"):
            jax.eval_shape(lambda q: quantized_decode_attention(
                q, stored, stored, tables, lens, codec=codec), q)


def test_gpu_blocks_shrink_to_the_target_shared_memory():
    """Float32 8B-shaped decode blocks fit an A100 only at fewer tokens than on an H100."""
    tokens = {}
    for name in ("h100", "a100"):
        with jax.sharding.use_abstract_mesh(dl.target_mesh(name).abstract_mesh):
            tokens[name] = gpu_block_tokens(rows=16, head_dim=128, dtype=jnp.float32)
    assert tokens["a100"] < tokens["h100"] <= 128


@pytest.mark.parametrize("case", [dl.Case("step_decode_fused", t, "bfloat16", "smollm2")
                                  for t in ("h100", "v5e")], ids=lambda c: c.id)
def test_engine_step_with_the_fused_kv_write_compiles(case):
    """fused_kv_write with the Pallas attention, on a qk_norm model (the keys' norm inside
    the kernel): the write is the target's own kernel beside the attention's (on TPU one
    Mosaic call more than the unfused step's)."""
    record = dl.compile_case(case)
    assert record["status"] == "compiled", record.get("reason")
    if dl.TARGETS[case.target].platform == "cuda":
        names = {k["kernel"] for k in record["kernels"]}
        assert {"fused_kv_write_looped", "paged_decode_looped"} <= names, names
    else:
        unfused = dl.compile_case(dataclasses.replace(case, program="step_decode"))
        assert record["mosaic_calls"] == unfused["mosaic_calls"] + 1
