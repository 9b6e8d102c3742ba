"""Session fixtures: the expensive model loads happen once per test session."""

from __future__ import annotations

import tempfile

import jax
import pytest
from hf_utils import import_torch

# Many tests build engines with identical step programs; a session-wide compilation cache turns
# every repeat compile into a lookup. (Compile counts are unaffected: they count programs each
# engine holds, not backend compilations.)
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="kvjax-xla-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def embedded_model():
    """kvjax's embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), float32."""
    from kvjax.models.loading import load_model

    return load_model(None, "float32")


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own load of the same GGUF file: float32, eval mode."""
    import transformers

    from kvjax.models.loading import embedded_model_path

    torch = import_torch()
    path = embedded_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_embedded_tokenizer():
    """transformers' tokenizer converted from the same GGUF file's metadata."""
    import transformers

    from kvjax.models.loading import embedded_model_path

    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
