"""Chunked (ragged) prefill attention over paged KV: the Pallas kernel and its jnp oracle."""

from pallas_kernels.ragged_prefill.kernel import ragged_prefill_attention
from pallas_kernels.ragged_prefill.reference import paged_prefill_attention_reference

__all__ = ["paged_prefill_attention_reference", "ragged_prefill_attention"]
