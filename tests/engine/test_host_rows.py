"""Host-resident rows: decode attention split between a host pool and the device pool gives the
device-only step's logits for every split, and a new split compiles nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.step import LogitsMode, StepPrograms, StepShape, empty_step_input
from kvjax.kv import pages as kv_pages
from kvjax.kv.state import init_paged_kv
from kvjax.testing import tiny_model

P, WIDTH, NUM_PAGES = 4, 8, 40


def _prefill(programs, model, kv, tables, prompts):
    lens = [len(p) for p in prompts]
    shape = StepShape(0, len(prompts), 64, WIDTH, row_chunk=32)
    buf = empty_step_input(shape)
    t0 = 0
    for b, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
        pos = np.arange(len(prompt))
        buf["tokens"][t0:t0 + len(prompt)] = prompt
        buf["positions"][t0:t0 + len(prompt)] = pos
        buf["slot_mapping"][t0:t0 + len(prompt)] = table[pos // P] * P + pos % P
        buf["block_tables"][b], buf["kv_lens"][b], buf["q_lens"][b] = table, lens[b], lens[b]
        buf["row_starts"][b] = t0
        buf["token_rows"][t0:] = b
        t0 += len(prompt)
    return programs.step(model.params, kv, buf, shape)[1]


def _decode_input(shape, tables, lens, tokens, *, host_rows):
    buf = empty_step_input(shape, host_rows=host_rows)
    for b, (n, table, token) in enumerate(zip(lens, tables, tokens, strict=True)):
        buf["tokens"][b], buf["positions"][b] = token, n
        buf["slot_mapping"][b] = table[n // P] * P + n % P
        buf["block_tables"][b] = table
        buf["kv_lens"][b], buf["q_lens"][b] = n + 1, 1
    return buf


def _copy(kv):
    return jax.tree.map(jnp.array, kv)


def test_every_split_gives_the_device_only_logits_and_compiles_once():
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n).astype(np.int32) for n in (13, 4, 21)]
    lens = [len(p) for p in prompts]
    perm = rng.permutation(NUM_PAGES).astype(np.int32)
    tables = [perm[i * WIDTH:(i + 1) * WIDTH] for i in range(3)]
    programs = StepPrograms(model.config)
    kv = _prefill(programs, model, init_paged_kv(model.config, NUM_PAGES, P), tables, prompts)
    shape = StepShape(4, 0, 1, WIDTH, logits_mode=LogitsMode.LAST)
    tokens = [7, 9, 11]
    want, _ = programs.step(model.params, _copy(kv),
                            _decode_input(shape, tables, lens, tokens, host_rows=False), shape)
    want = np.asarray(want.logits)[:3]
    splits = [[0, 0, 0], [3, 1, 5], [1, 0, 2], [3, 1, 5]]  # every row's full pages, and fewer
    compiles = []
    for host_pages in splits:
        host_kv = init_paged_kv(model.config, 16, P)
        device_kv = _copy(kv)
        buf = _decode_input(shape, tables, lens, tokens, host_rows=True)
        free_host = list(rng.permutation(16).astype(np.int32))
        for b, h in enumerate(host_pages):
            if not h:
                continue
            dst = np.asarray([free_host.pop() for _ in range(h)], np.int32)
            blob = kv_pages.gather_pages(device_kv, jnp.asarray(tables[b][:h]))
            host_kv = kv_pages.scatter_pages(host_kv, jnp.asarray(dst), blob)
            # The device copies are gone: NaN shows any stray read.
            device_kv = device_kv.with_page_leaves(
                [x.at[:, tables[b][:h]].set(jnp.nan) for x in device_kv.page_leaves()])
            buf["host_tables"][b, :h] = dst
            buf["host_lens"][b] = h * P
        out, _ = programs.step(model.params, device_kv, buf, shape, host_kv=host_kv)
        got = np.asarray(out.logits)[:3]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
        compiles.append(programs.num_compiles)
    assert compiles[0] == compiles[-1], compiles


# ----------------------------------------------------------------------------- the engine

ENGINE = dict(page_size=P, num_pages=14, max_num_seqs=3, max_num_batched_tokens=32,
              max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=48,
              enable_prefix_cache=False)
PROMPTS = [[7, 21, 3, 90, 14, 60, 33, 8, 5, 41, 77], [2, 99, 64, 18, 30, 11, 45, 70, 6],
           [7, 21, 3, 90, 14, 60, 33, 8, 12, 50, 3, 9, 9]]
NUM_NEW = 12


def _serve(model, sampling=None, *, warm=False, **config):
    from kvjax import EngineConfig, SamplingParams
    from kvjax.engine.engine import Engine

    engine = Engine(model, EngineConfig(**{**ENGINE, **config}))
    compiles = engine.warmup() if warm else None
    sampling = sampling or SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True)
    outs = engine.generate(PROMPTS, sampling)
    assert not [o.error for o in outs if o.error]
    if warm:  # every split of every step ran on the warmed-up programs
        assert engine.num_compiles == compiles
    assert engine.allocator.num_used_pages() == 0, "pages leaked"
    host = engine.kv_cache.host_pool
    assert host is None or host.num_free() == host.num_pages, "host pages leaked"
    return [[c.token_ids for c in o.outputs] for o in outs], engine


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def oracle(model):
    from kvjax.testing import greedy_reference

    return [[greedy_reference(model, p, NUM_NEW)] for p in PROMPTS]


def test_random_splits_with_int8_prefix_cache_swap_and_n2_match_the_device_only_engine(model):
    """A seeded random split every step, under preemption by swap with a pool too small for
    the batch; the device-only engine of the same settings is the oracle (int8 pages)."""
    from kvjax import SamplingParams

    sampling = [SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True, n=n) for n in (2, 1, 1)]
    config = dict(kv_codec="int8", enable_prefix_cache=True, preemption_mode="swap",
                  num_pages=14)
    want, plain = _serve(model, sampling, **config)
    # A host pool of two pages leaves the device pool short: a host-resident row is swapped.
    got, engine = _serve(model, sampling, warm=True, host_split="random",
                         host_split_options=dict(seed=1), num_host_pages=2, **config)
    assert got == want and [len(t) for t in got] == [2, 1, 1]
    assert plain.stats["swaps_out"] > 0 and engine.stats["swaps_out"] > 0
    assert engine.stats["host_pages_out"] > 0 and engine.stats["host_pages_in"] > 0


@pytest.mark.parametrize("split,config", [
    ("when_full", dict(num_pages=9)),
    ("always", dict()),
    # debug_provenance: every page a row reads, host-resident ones too, has its weights version
    ("random", dict(enable_prefix_cache=True, debug_provenance=True)),
    ("never", dict()),
    # rates at which the host takes the longest rows: 1e6 tokens/s beside a 10 ms step
    ("neo", dict(num_pages=9, host_split_options=dict(host_tokens_per_s=1e6,
                                                       device_tokens_per_s=1e7,
                                                       device_step_s=1e-2))),
])
def test_greedy_tokens_match_the_dense_oracle_for_every_split(model, oracle, split, config):
    tokens, engine = _serve(model, host_split=split, num_host_pages=24, **config)
    assert tokens == oracle
    if split == "never":
        assert engine.kv_cache.host_pool is None
    else:
        assert engine.stats["host_pages_out"] > 0
    if split == "when_full":  # rows went to the host pool instead of being preempted
        assert engine.stats["host_offloads"] > 0 and engine.stats["preemptions"] == 0


def test_features_that_cannot_compose_are_refused(model):
    import dataclasses
    import re

    from kvjax import EngineConfig
    from kvjax.engine import compat
    from kvjax.engine.compat import Feature
    from kvjax.engine.engine import Engine

    windowed = tiny_model(dataclasses.replace(model.config, layer_windows=(8, 0)))
    reason = compat.MODEL_REFUSED[(compat.ModelTrait.LAYER_GROUPS, Feature.HOST_ROWS)]
    with pytest.raises(ValueError, match=re.escape(reason)):
        Engine(windowed, EngineConfig(**{**ENGINE, "host_split": "always",
                                         "num_host_pages": 8}))
    with pytest.raises(ValueError, match="retention='h2o' and host_split='neo'"):
        EngineConfig(**{**ENGINE, "host_split": "neo", "num_host_pages": 8,
                        "retention": "h2o", "retention_budget": 16})
    with pytest.raises(ValueError, match="unknown host split policy 'sometimes'"):
        EngineConfig(host_split="sometimes")
