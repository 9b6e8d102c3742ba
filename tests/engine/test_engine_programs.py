"""Each engine owns its compiled programs: its compile count moves only when it compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax import jit as kvjax_jit
from kvjax.engine.engine import Engine
from kvjax.testing import tiny_model


def _double(x):
    return 2 * x


def test_programs_of_one_function_count_apart_and_survive_cleared_jax_caches():
    first, second = kvjax_jit.jit(_double), kvjax_jit.jit(_double)
    first(jnp.zeros(3))
    assert (first.num_compiles, second.num_compiles) == (1, 0)
    second(jnp.zeros(3))
    second(jnp.zeros(5))
    assert (first.num_compiles, second.num_compiles) == (1, 2)
    jax.clear_caches()  # What an eviction from jax's process-wide LRU does.
    first(jnp.zeros(3))
    assert (first.num_compiles, second.num_compiles) == (1, 2)


def _serve(engine: Engine, rng: np.random.Generator, num: int) -> None:
    for i in range(num):
        prompt = [int(t) for t in rng.integers(0, 120, size=int(rng.integers(1, 40)))]
        engine.add_request(f"r{rng.integers(1 << 30)}-{i}", prompt,
                           SamplingParams(max_new_tokens=int(rng.integers(1, 10))))
    while engine.has_unfinished():
        engine.step()


def test_one_engines_compile_count_does_not_move_when_another_compiles():
    model = tiny_model()
    base = dict(max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=8,
                preemption_mode=PreemptionMode.SWAP, scrub_freed_pages=True)
    rng = np.random.default_rng(0)
    first = Engine(model, EngineConfig(**base, page_size=4, num_pages=24))
    first_warm = first.warmup()
    assert first_warm > 0
    # Other page and pool sizes: the swap, scrub and step programs compile other shapes.
    second = Engine(model, EngineConfig(**base, page_size=8, num_pages=16))
    second_warm = second.warmup()
    assert second_warm > 0
    assert first.num_compiles == first_warm
    _serve(second, rng, 12)
    assert second.num_compiles == second_warm
    assert first.num_compiles == first_warm
    _serve(first, rng, 12)
    assert first.num_compiles == first_warm
    assert second.num_compiles == second_warm
