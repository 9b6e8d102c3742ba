"""Paged decode attention over quantized KV pages (int8, fp8, packed int4/int2) and its oracle."""

from pallas_kernels.quantized_decode.kernel import (
    CodeFormat,
    code_format,
    quantized_decode_attention,
)
from pallas_kernels.quantized_decode.reference import quantized_decode_attention_reference

__all__ = ["CodeFormat", "code_format", "quantized_decode_attention",
           "quantized_decode_attention_reference"]
