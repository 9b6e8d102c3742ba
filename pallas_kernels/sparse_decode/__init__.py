"""Sparse page-subset decode attention (Quest-style page selections) and its oracle."""

from pallas_kernels.sparse_decode.kernel import sparse_decode_attention
from pallas_kernels.sparse_decode.reference import (
    selected_token_mask,
    sparse_decode_attention_reference,
)

__all__ = ["selected_token_mask", "sparse_decode_attention", "sparse_decode_attention_reference"]
