"""The fused KV write: K/V projection, RoPE on K and the rows' store into their pages in one
Pallas kernel, and its jnp oracle."""

from pallas_kernels.fused_kv_write.kernel import fused_kv_write
from pallas_kernels.fused_kv_write.reference import fused_kv_write_reference

__all__ = ["fused_kv_write", "fused_kv_write_reference"]
