"""How the quantized decode kernel's schedules read a codec's storage."""

from __future__ import annotations

import enum


class CodeFormat(enum.Enum):
    """How the kernel reads a codec's storage."""

    INT8 = "int8"  # int8 codes, one scale per token per kv head.
    FP8 = "fp8"  # float8 codes, one scale per token per kv head (dynamic scaling).
    # Asymmetric 8-, 4- or 2-bit codes (8 / bits per byte), scale and zero per channel group.
    PACKED = "packed"
