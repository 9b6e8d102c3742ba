"""Paged decode attention: the Pallas kernel and its jnp oracle."""

from pallas_kernels.paged_decode.kernel import Schedule, default_schedule, paged_decode_attention
from pallas_kernels.paged_decode.reference import paged_decode_attention_reference

__all__ = ["Schedule", "default_schedule", "paged_decode_attention",
           "paged_decode_attention_reference"]
