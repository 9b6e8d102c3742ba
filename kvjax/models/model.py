"""The `Model` bundle: config, params pytree, tokenizer and weights version."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model.

    Attributes:
      config: the architecture.
      params: the params pytree (see `kvjax.models.llama` for its layout).
      tokenizer: a `kvjax.models.tokenizer.Tokenizer`, or None for id-only use.
      weights_version: part of the KV provenance fingerprint; bumped by weight updates.
      source: where the weights came from (path or 'random'), for logs and reports.
    """

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    weights_version: str = "0"
    source: str = ""

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the params (what the weights take wherever they are)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.params))
