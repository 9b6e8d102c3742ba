"""The kernels follow the target being compiled for, not the CPU they are traced on.

An abstract mesh whose device is a GPU or TPU (what a deviceless compile traces under) picks
the schedule, the fp8 refusal and the GPU block sizes. The compiles themselves run in the
deviceless tier (tests_deviceless/, `make test-deviceless`); these checks need no plugin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice  # No public constructor; the tier gets it from a topology.
from jax.sharding import AbstractMesh

from kvjax.config import ModelConfig
from kvjax.kv import codecs
from kvjax.kv.quantized import init_quantized_kv
from pallas_kernels import dispatch, targets
from pallas_kernels.paged_decode.kernel import (
    Schedule,
    default_schedule,
    gpu_block_tokens,
    gpu_smem_estimate,
)
from pallas_kernels.quantized_decode.kernel import quantized_decode_attention

_KINDS = {"h100": ("NVIDIA H100 80GB HBM3", "cuda"), "a100": ("NVIDIA A100-SXM4-80GB", "cuda"),
          "v5e": ("TPU v5 lite", "tpu")}
_CONFIG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=32)


def on(target: str):
    kind, platform = _KINDS[target]
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def test_platform_and_schedule_follow_the_abstract_device():
    assert targets.current_platform() == jax.default_backend()
    with on("h100"):
        assert targets.current_platform() == "gpu"
        assert default_schedule() is Schedule.LOOPED
        assert targets.current_gpu().shared_memory_per_block == 232_448
    with on("v5e"):
        assert targets.current_platform() == "tpu"
        assert default_schedule() is Schedule.PIPELINED


def test_fp8_pools_refused_below_sm89_with_the_reason():
    kv = init_quantized_kv(_CONFIG, 4, 16, "fp8_e4m3", scaling="dynamic")
    int8 = init_quantized_kv(_CONFIG, 4, 16, "int8")
    with on("a100"):
        assert "compute capability 8.9" in dispatch.unsupported_reason(kv)
        assert "A100 is sm_80" in dispatch.unsupported_reason(kv)
        assert dispatch.unsupported_reason(int8) is None
        with pytest.raises(ValueError, match="compute capability 8.9"):
            dispatch.kernels_for(kv)
    with on("h100"):
        assert dispatch.unsupported_reason(kv) is None
    with on("v5e"):  # The TPU kernel decodes float8 from its bytes.
        assert dispatch.unsupported_reason(kv) is None
        assert dispatch.unsupported_reason(int8) is None


def test_fp8_kernel_raises_before_lowering_on_sm80():
    codec = codecs.get_codec("fp8_e4m3", scaling="dynamic")
    spec = codec.storage_spec(4 * 16, 2, 32)
    stored = {n: jnp.zeros((4, 16) + s.shape[1:], s.dtype) for n, s in spec.items()}
    q = jnp.zeros((2, 4, 32), jnp.bfloat16)
    call = lambda q: quantized_decode_attention(q, stored, stored, jnp.zeros((2, 2), jnp.int32),
                                                jnp.ones(2, jnp.int32), codec=codec)
    with on("a100"), pytest.raises(ValueError, match="sm_80"):
        jax.eval_shape(call, q)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_blocks_fit_each_target(dtype, head_dim):
    """The chosen block fits the target's shared memory, and the smaller SM gets no larger
    block; float32 8B-shaped decode must shrink below 128 tokens on both."""
    tokens = {}
    for target in ("h100", "a100"):
        with on(target):
            tokens[target] = gpu_block_tokens(rows=16, head_dim=head_dim, dtype=dtype)
            assert gpu_smem_estimate(rows=16, head_dim=head_dim, block_tokens=tokens[target],
                                     dtype=dtype) <= targets.current_gpu().shared_memory_per_block
    assert 16 <= tokens["a100"] <= tokens["h100"] <= 128
    if dtype == jnp.float32 and head_dim == 128:
        assert tokens["h100"] < 128 and tokens["a100"] < tokens["h100"]
