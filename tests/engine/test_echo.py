"""Host-authoritative sparse KV (ECHO): the device keeps, per layer, a budget of each decode
row's pages, the host pool all of them; the exact Quest selection and the greedy tokens equal
plain Quest's at every step, whatever the prefetch guessed, and the residency compiles nothing
new."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.echo import keep_misses
from kvjax.engine.engine import Engine
from kvjax.engine.runner import StepObserver
from kvjax.engine.step import AttentionImpl
from kvjax.scheduler.echo import kept_misses, wanted_pages
from kvjax.testing import tiny_model

P = 4
ENGINE = dict(page_size=P, num_pages=40, max_num_seqs=2, max_num_batched_tokens=32,
              max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1, max_model_len=64,
              retention="quest", retention_budget=2 * P, attention_impl=AttentionImpl.REFERENCE)
NUM_NEW = 10


class _Selections(StepObserver):
    """Each decode step's exact selection (`StepOutput.page_reads`), as the step made it."""

    def __init__(self):
        self.steps: list[np.ndarray] = []

    def after_step(self, shape, buf, out) -> None:
        if out.page_reads is not None:
            self.steps.append(np.asarray(out.page_reads))


class _Claims(StepObserver):
    """Before each step: every (layer, entry) the row's layer table puts on the device holds,
    in that layer of that device page, the entry's host copy (whatever frames earlier steps
    kept their misses in); counts the claims checked."""

    def __init__(self, engine):
        self.engine, self.checked, self.merged = engine, 0, 0

    def before_step(self, shape, buf) -> None:
        runner = self.engine.runner
        skip = self.engine.kv_cache.retention.policy.num_index_leaves  # summaries: not KV
        device = [np.asarray(x) for x in runner.kv.page_leaves()[:-skip]]
        host = [np.asarray(x) for x in runner.host_pool.kv.page_leaves()[:-skip]]
        tables = buf["layer_tables"].copy()
        if buf["kept_rows"].size:  # what the previous step kept, read on the device
            kept = np.asarray(buf["kept_feed"])[np.maximum(buf["kept_rows"], 0)]
            entry = np.where(kept >= 0, kept, buf["kept_owners"])
            for b, layer, v in zip(*np.nonzero(
                    (buf["kept_rows"] >= 0)[:, None, None] & (entry >= 0)
                    & (buf["kept_pages"] >= 0)), strict=True):
                tables[b, layer, entry[b, layer, v]] = buf["kept_pages"][b, layer, v]
                self.merged += 1
        for b in range(tables.shape[0]):
            for layer, j in zip(*np.nonzero(tables[b] >= 0), strict=True):
                src = buf["host_tables"][b, j]
                if src < 0 or buf["kv_lens"][b] == 0:
                    continue
                dst = tables[b, layer, j]
                for d, h in zip(device, host, strict=True):
                    np.testing.assert_array_equal(d[layer, dst], h[layer, src])
                self.checked += 1


def _serve(model, prompts, *, warm=False, config=(), **options):
    """Plain Quest (recording its selections) without options, else ECHO (its device pages
    checked against the host copies before every step)."""
    engine = Engine(model, EngineConfig(
        **{**ENGINE, **dict(config)},
        retention_options=dict(dense_layers=1, **(options or dict(record_reads=True))),
        num_host_pages=32 if options else 0))
    compiles = engine.warmup() if warm else None
    seen = _Selections()
    engine.runner.observers.append(seen)
    if options:
        claims = _Claims(engine)
        engine.runner.observers.append(claims)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True))
    assert not [o.error for o in outs if o.error]
    if warm:
        assert engine.num_compiles == compiles
    assert engine.allocator.num_used_pages() == 0, "pages leaked"
    host = engine.kv_cache.host_pool
    assert host is None or host.num_free() == host.num_pages, "host pages leaked"
    if options:
        assert claims.checked > 0
        engine.stats["claims_merged"] = claims.merged
    return [o.outputs[0].token_ids for o in outs], seen.steps, engine


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_echo_selection_and_tokens_equal_plain_quest_at_every_step(model):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 120, size=n)] for n in (29, 22)]
    config = dict(enable_prefix_cache=False)  # pages the row alone holds become frames
    want, want_reads, _ = _serve(model, prompts, config=config)
    got, got_reads, engine = _serve(model, prompts, warm=True, config=config, echo_prefetch=0)
    assert got == want
    assert len(got_reads) == len(want_reads) >= NUM_NEW - 1
    for step, (a, b) in enumerate(zip(got_reads, want_reads, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {step}")
    stats = engine.stats
    # The device kept a budget per layer: pages left it, the row's own pages became its
    # frames, layers of pages came back into them, and the step read some (layer, page)
    # pairs from the host pool.
    assert stats["echo_pages_released"] > 0 and stats["echo_frames_adopted"] > 0
    assert stats["echo_layer_pages_prefetched"] > 0
    assert 0 < stats["echo_resident_reads"] < stats["echo_selected_pages"]
    # Asynchronous scheduling (the default): steps kept misses in frames, and the next step
    # read them there before the host had read back which (checked against the host copies).
    assert stats["echo_misses_kept"] > 0 and stats["claims_merged"] > 0


def test_misses_kept_in_frames_are_not_fetched_again(model):
    """Synchronous scheduling, misses kept or not: the same exact selection and tokens, every
    device claim holds its page (`_Claims`), and keeping them moves fewer layers of pages in
    (fewer of them pages the step before had just fetched as misses) for no fewer resident
    reads."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 120, size=30)]]
    config = dict(enable_prefix_cache=False, async_scheduling=False)
    runs = {keep: _serve(model, prompts, config=config, echo_prefetch=1, echo_keep_misses=keep)
            for keep in (False, True)}
    (want, want_reads, plain), (got, got_reads, kept) = runs[False], runs[True]
    assert got == want
    for a, b in zip(got_reads, want_reads, strict=True):
        np.testing.assert_array_equal(a, b)
    assert plain.stats["echo_misses_kept"] == 0 < kept.stats["echo_misses_kept"]
    assert kept.stats["echo_refetched_layer_pages"] < plain.stats["echo_refetched_layer_pages"]
    assert (kept.stats["echo_layer_pages_prefetched"]
            < plain.stats["echo_layer_pages_prefetched"])
    assert kept.stats["echo_resident_reads"] >= plain.stats["echo_resident_reads"]


def test_the_host_knows_which_frame_each_miss_went_to():
    """The host's rule (`kept_misses`, applied to the selection it reads back) names the
    pages the step's write (`keep_misses`) put in the offered frames, on random rows."""
    import jax.numpy as jnp
    from flax import struct

    rng = np.random.default_rng(3)
    bd, layers, width, v = 3, 4, 8, 3

    @struct.dataclass
    class Pool:  # one leaf: page p of layer l holds 1000 * l + p
        x: jnp.ndarray
        num_pages: int = struct.field(pytree_node=False)

        def page_leaves(self):
            return [self.x]

        def with_page_leaves(self, leaves):
            return self.replace(x=leaves[0])

    host_tables = np.where(rng.random((bd, width)) < 0.8, rng.permutation(bd * width)
                           .reshape(bd, width) + 100, -1).astype(np.int32)
    block_tables = rng.permutation(bd * width).reshape(bd, width).astype(np.int32)
    layer_tables = np.where(rng.random((bd, layers, width)) < 0.4, 7, -1).astype(np.int32)
    reads = rng.random((bd, layers, width)) < 0.5
    frames = np.stack([np.stack([rng.permutation(width)[:v] for _ in range(layers)])
                       for _ in range(bd)]).astype(np.int32)
    frames[0, 0, 2] = -1
    owners = rng.integers(-1, width, (bd, layers, v)).astype(np.int32)
    device = Pool(jnp.zeros((layers, bd * width, 1)), bd * width)
    host = Pool(jnp.asarray(1000.0 * np.arange(layers)[:, None, None]
                            + np.arange(bd * width + 100)[None, :, None]), bd * width + 100)
    inp = type("Inp", (), dict(keep_frames=jnp.asarray(frames), keep_owners=jnp.asarray(owners),
                               layer_tables=jnp.asarray(layer_tables),
                               host_tables=jnp.asarray(host_tables),
                               block_tables=jnp.asarray(block_tables)))
    pool, kept_device = keep_misses(device, host, jnp.asarray(reads), inp, bd)
    got = np.asarray(pool.x)[..., 0]
    written = 0
    for b in range(bd):
        kept = kept_misses(reads[b], layer_tables[b], host_tables[b], frames[b], owners[b])
        np.testing.assert_array_equal(np.asarray(kept_device[b]), kept)
        want = np.zeros((layers, bd * width))
        for layer, i in zip(*np.nonzero(kept >= 0), strict=True):
            want[layer, block_tables[b, frames[b, layer, i]]] = \
                1000 * layer + host_tables[b, kept[layer, i]]
            written += 1
        mine = np.zeros_like(want, bool)
        mine[:, block_tables[b]] = True
        np.testing.assert_array_equal(np.where(mine, got, 0), want)
    assert written > 0


def test_each_layer_keeps_its_own_reads_then_the_most_read_pages():
    reads = np.array([[1, 0, 0, 1, 0, 0],
                      [0, 1, 0, 0, 0, 0],
                      [0, 1, 0, 1, 0, 0]], bool)  # [L, W]
    got = wanted_pages(reads, 5, 2)
    assert [sorted(w.tolist()) for w in got] == [[0, 3], [1, 3], [1, 3]]
    # Own reads come first, in order of how many layers read them, ties to the newest.
    assert wanted_pages(reads, 5, 1)[0].tolist() == [3]
    assert wanted_pages(reads, 5, 3)[1].tolist() == [1, 3, 0]


def test_plain_quest_sends_no_selection_back(model):
    """Without ECHO or record_reads the step returns no per-layer selection, so the host
    copies nothing back per decode step."""
    engine = Engine(model, EngineConfig(**ENGINE, retention_options=dict(dense_layers=1)))
    seen = _Selections()
    outputs = []
    engine.runner.observers.append(seen)
    original = engine.scheduler.update_from_output

    def update(so, out):
        outputs.append(out)
        return original(so, out)

    engine.scheduler.update_from_output = update
    engine.generate([[3, 5, 7] * 5], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert outputs and all(o.page_reads is None for o in outputs)
    assert seen.steps == []


@pytest.mark.parametrize("config", [
    dict(kv_codec="int8", enable_prefix_cache=True),
    dict(async_scheduling=False, max_num_seqs=3),
])
def test_echo_with_more_behaviours_matches_plain_quest(model, config):
    """Prefetch margins 0 and 3 over int8 pages with the prefix cache (prompts sharing pages),
    and synchronous scheduling with three rows; plain Quest of the same settings is the
    oracle, step by step."""
    shared = [int(t) for t in np.random.default_rng(1).integers(0, 120, size=16)]
    prompts = [shared + [5, 41, 77, 3, 9], shared + [12, 50], [7, 3] * 12]
    want, want_reads, _ = _serve(model, prompts, config=config)
    for prefetch in (0, 3):
        got, got_reads, engine = _serve(model, prompts, config=config, echo_prefetch=prefetch)
        assert got == want
        assert len(got_reads) == len(want_reads)
        for a, b in zip(got_reads, want_reads, strict=True):
            np.testing.assert_array_equal(a, b)
        assert engine.stats["echo_pages_mirrored"] > 0
        if config.get("enable_prefix_cache"):  # cached pages are not overwritten: fresh frames
            assert engine.stats["echo_frames_taken"] > 0


def test_echo_settings_are_checked(model):
    from kvjax.kv.retention import make_retention

    with pytest.raises(ValueError, match="echo_prefetch must be None or an int >= 0, got -1"):
        make_retention("quest", 2 * P, P, echo_prefetch=-1)
    with pytest.raises(ValueError, match="echo_keep_misses must be a bool, got 1"):
        make_retention("quest", 2 * P, P, echo_prefetch=1, echo_keep_misses=1)
    with pytest.raises(ValueError, match="num_host_pages must be > 0, got 0"):
        Engine(model, EngineConfig(**ENGINE, retention_options=dict(echo_prefetch=2)))
