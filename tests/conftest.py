"""Session fixtures: the expensive model loads happen once per test session."""

from __future__ import annotations

import os
import tempfile

import jax
import pytest
from hf_utils import gguf_parsed_once, import_torch

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
def policy_models():
    """(a tiny policy, the same architecture with other weights: what training updates it to)."""
    from kvjax.testing import tiny_model

    return tiny_model(seed=0), tiny_model(seed=1)


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own load of the same GGUF file: float32, eval mode."""
    import transformers

    from kvjax.models.loading import embedded_model_path

    torch = import_torch()
    path = embedded_model_path()
    with gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_embedded_tokenizer():
    """transformers' tokenizer converted from the same GGUF file's metadata."""
    import transformers

    from kvjax.models.loading import embedded_model_path

    path = embedded_model_path()
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


_SLOW_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_cases.txt")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the cases tests/slow_cases.txt lists as slow; a listed case that no longer exists
    in a collected file fails a run of whole files, so the list cannot go stale."""
    with open(_SLOW_CASES) as f:
        listed = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    ids = {item.nodeid: item for item in items}
    whole_files = not any("::" in arg for arg in config.args)
    files = {nodeid.split("::")[0] for nodeid in ids} if whole_files else set()
    for case in listed:
        matched = [item for nodeid, item in ids.items()
                   if nodeid == case or nodeid.startswith(case + "[")]
        if not matched and case.split("::")[0] in files:
            raise pytest.UsageError(f"tests/slow_cases.txt lists {case}, which is not a test")
        for item in matched:
            item.add_marker(pytest.mark.slow)
    # `make test` (--dist loadgroup) sends the tests of one group to one test process. A test
    # that uses an expensive session fixture joins that fixture's group, so it loads once; the
    # other tests are grouped by module, so a module's fixtures and the programs its engines
    # compile are built in one process, not in each (ungrouped tests go one at a time to
    # whichever process is free, so neighbours of one module land in both).
    for item in items:
        shared = sorted(_GROUPED_FIXTURES.intersection(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared
                                                else item.nodeid.split("::")[0]))


_GROUPED_FIXTURES = frozenset({"hf_embedded", "sharded"})


# jit keeps its compiled programs in one process-wide LRU of at most 8192 jitted functions. A
# test process that builds engines for hundreds of tests fills it; an entry of a running
# engine dropped there compiles again at its next call, which a `kvjax.jit.Program` counts as
# a new program when that call's arguments differ from the first compile's only in what jax's
# cache does not key on. Emptying the cache between modules once it is half full keeps every
# module's engines clear of that.
_JIT_CACHE_LIMIT = 4096


@pytest.fixture(autouse=True, scope="module")
def _bounded_jit_cache():
    yield
    from jax._src import pjit  # the sizes are not public; without them, clear every module
    caches = [getattr(pjit, name, None) for name in
              ("_cpp_pjit_cache_fun_only", "_cpp_pjit_cache_explicit_attributes")]
    if any(c is None or c.size() > _JIT_CACHE_LIMIT for c in caches):
        jax.clear_caches()
