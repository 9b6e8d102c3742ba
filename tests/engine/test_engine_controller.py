"""An engine under a KV controller: decisions carried out, exact requests kept exact, lossy
ones within their KL budgets, nothing dropped, nothing recompiled."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.scheduler.controller import SLO
from kvjax.testing import TINY, greedy_reference, tiny_model

NUM_NEW = 8
TABLE = {"4": 0.3, "8": 0.1}
BASE = dict(page_size=4, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16,
            max_prefill_chunk=16, min_chunk_bucket=16, max_prefill_seqs=1, max_model_len=40,
            enable_prefix_cache=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(1)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist()
            for n in (20, 18, 22, 12, 16)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [greedy_reference(model, p, NUM_NEW) for p in prompts]


def serve(model, prompts, config, kl_budgets):
    """Serves the prompts, the later ones outranking the earlier ones (so the controller
    makes room for them); returns the outputs by index and the engine."""
    engine = Engine(model, EngineConfig(**{**BASE, **config}))
    compiles = engine.warmup()
    for i, (prompt, kl) in enumerate(zip(prompts, kl_budgets, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NUM_NEW,
                                                           ignore_eos=True),
                           priority=i // 2, slo=SLO(ttft_s=60.0, tpot_s=60.0, kl_budget=kl))
    outs = {}
    while engine.has_unfinished():
        outs.update((int(o.request_id[1:]), o) for o in engine.step())
    assert engine.num_compiles == compiles, "a controller decision compiled a program"
    assert engine.allocator.num_used_pages() == 0
    return outs, engine


def test_joint_controller_keeps_exact_requests_exact(model, prompts, reference):
    """Exact-only SLOs: the joint controller may only reorder, preempt and swap, so greedy
    tokens equal the cache-free reference."""
    outs, engine = serve(model, prompts, dict(controller="joint", controller_options=dict(
        retention_kl=TABLE, demote_kl=0.01)), [0.0] * len(prompts))
    assert engine.stats["preemptions"] > 0 and engine.stats["demoted_swaps"] == 0
    for i, ref in enumerate(reference):
        assert outs[i].outputs[0].token_ids == ref and outs[i].kl_spent == 0.0


def test_demoted_swaps_move_fewer_bytes_within_the_kl_budget(model, prompts, reference):
    """Swap preemption with int8 host copies for the requests that accept their KL: fewer
    host bytes than full copies, their KL spent reported, the exact-only ones untouched."""
    budgets = [0.0, 0.0, 0.5, 0.5, 0.5]  # the victims (the latest arrivals) accept int8
    config = dict(preemption_mode="swap", num_pages=10)
    plain, plain_engine = serve(model, prompts, dict(config, controller="fixed"), budgets)
    demoted, engine = serve(model, prompts, dict(config, controller="codec",
                                                 controller_options=dict(demote_kl=0.01)),
                            budgets)
    assert engine.stats["demoted_swaps"] > 0
    assert engine.stats["swaps_out"] == plain_engine.stats["swaps_out"]
    assert engine.stats["swap_bytes"] < plain_engine.stats["swap_bytes"]
    for i, kl in enumerate(budgets):
        out = demoted[i]
        assert len(out.outputs[0].token_ids) == NUM_NEW
        if kl == 0.0:
            assert out.kl_spent == 0.0 and out.outputs[0].token_ids == reference[i]
        assert out.kl_spent <= kl
    assert any(demoted[i].kl_spent > 0 for i in range(len(prompts)))


def test_int4_copies_when_the_budget_allows_move_fewer_bytes(prompts):
    """exact -> int8 -> int4: a KL budget that fits int4 stores the swapped copies at four
    bits (a model with head dim 32, where int4's metadata does not eat the saving); each
    request's KL is counted once (a copy no finer than one it went through adds none)."""
    model = tiny_model(dataclasses.replace(TINY, head_dim=32))
    budgets = [0.0, 0.0, 0.5, 0.5, 0.5]
    config = dict(preemption_mode="swap", num_pages=10, controller="codec")
    runs = {}
    for levels in ({8: 0.01}, {8: 0.01, 4: 0.05}):
        outs, engine = serve(model, prompts, dict(config, controller_options=dict(
            demote_kl=levels)), budgets)
        assert engine.stats["demoted_swaps"] > 0
        runs[len(levels)] = outs, engine.stats
    (int8, int8_stats), (int4, int4_stats) = runs[1], runs[2]
    assert int4_stats["swaps_out"] == int8_stats["swaps_out"]
    assert int4_stats["swap_bytes"] < int8_stats["swap_bytes"]
    assert all(int4[i].kl_spent in (0.0, 0.05) for i in (2, 3, 4))
    assert any(int4[i].kl_spent == 0.05 for i in (2, 3, 4))
    for i in (0, 1):
        assert int4[i].outputs[0].token_ids == int8[i].outputs[0].token_ids
        assert int4[i].kl_spent == 0.0


@pytest.mark.parametrize("bits,codec", [(8, "int8"), (4, "int4")])
def test_demoted_copies_hold_what_a_pool_of_that_codec_would(bits, codec):
    """A demoted copy is encoded by the KV codec its KL table was measured with: restored
    values equal that codec's round trip, in fewer bytes; leaves that are not float K/V
    travel unchanged."""
    from kvjax.engine.swap import demote_blob, demoted_nbytes, restore_blob
    from kvjax.kv.codecs import get_codec

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 2, 64)).astype(np.float32)  # [L, n, P, K, D]
    codes = rng.integers(-127, 127, size=(2, 3, 4, 2, 64)).astype(np.int8)
    parts = demote_blob([x, codes], bits)
    assert sum(p.nbytes for p in parts[0]) == demoted_nbytes(x, bits) < x.nbytes / 3
    restored, same = restore_blob(parts, [x.dtype, codes.dtype], bits)
    c = get_codec(codec)
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(c.decode(c.encode(x))))
    assert np.abs(np.asarray(restored) - x).max() < 0.05 * 2 ** (8 - bits)
    np.testing.assert_array_equal(np.asarray(same), codes)


def test_retention_budgets_within_each_requests_kl_budget(model, prompts, reference):
    """A streaming engine whose sequences start exact: the controller shrinks the budgets of
    requests that accept the loss (measured table), never the exact-only ones'."""
    budgets = [1.0, 0.2, 0.0, 1.0, 0.0]
    outs, engine = serve(model, prompts, dict(
        controller="retention", controller_options=dict(retention_kl=TABLE),
        retention="streaming", retention_budget=12, retention_options=dict(num_sinks=2)),
        budgets)
    assert engine.retention.stats["evictions"] > 0
    for i, kl in enumerate(budgets):
        assert outs[i].kl_spent <= kl
        if kl == 0.0:
            assert outs[i].outputs[0].token_ids == reference[i]
    assert any(outs[i].kl_spent > 0 for i in range(len(prompts)))


def test_bad_slo_fails_alone(model, prompts):
    engine = Engine(model, EngineConfig(**BASE, controller="joint"))
    with pytest.raises(ValueError, match="request 'bad'.*slo"):
        engine.add_request("bad", prompts[0], slo={"ttft_s": 1.0})
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=-1.0)
    engine.add_request("ok", prompts[0], SamplingParams(max_new_tokens=2))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="unknown controller"):
        EngineConfig(controller="nope")


def test_prefix_controller_keeps_reused_pages_over_one_off_ones(model, reference, prompts):
    """A shared system prompt reused now and then, one-off prompts between its uses that need
    most of the pool: LRU evicts the system prompt's pages (released before the one-offs'),
    the `prefix` controller keeps them (reused) and the later requests hit them. Tokens stay
    the cache-free reference's either way."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, model.config.vocab_size, size=8).tolist()
    shared = [system + rng.integers(3, model.config.vocab_size, size=4).tolist()
              for _ in range(4)]
    order = [shared[0], shared[1], prompts[0], prompts[2], shared[2], prompts[1], prompts[4],
             shared[3]]
    expected = [greedy_reference(model, p, NUM_NEW) for p in order]
    hits = {}
    for controller in ("fixed", "prefix"):
        engine = Engine(model, EngineConfig(**{**BASE, "enable_prefix_cache": True,
                                               "num_pages": 12, "controller": controller}))
        compiles = engine.warmup()
        for i, prompt in enumerate(order):  # one at a time: each finds what the last left
            engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NUM_NEW,
                                                               ignore_eos=True))
            out = [o for _ in iter(engine.has_unfinished, False) for o in engine.step()]
            assert out[0].outputs[0].token_ids == expected[i]
        assert engine.num_compiles == compiles
        hits[controller] = engine.prefix_cache_stats()["prefix_hit_tokens"]
    assert hits["prefix"] > hits["fixed"]


def test_the_snapshot_shows_cached_pages_and_host_room(model, prompts):
    """What a controller sees of the prefix cache and the host tier: each unreferenced
    cached page with its reuses and depth, and the tier's free bytes (inf without one)."""
    from kvjax.memory.tiers import TierConfig

    tiers = TierConfig(host_bytes=1 << 20)
    for config, room in ((dict(), np.inf), (dict(tiers=tiers), 1 << 20)):
        engine = Engine(model, EngineConfig(**{**BASE, "enable_prefix_cache": True,
                                               "controller": "prefix", **config}))
        for i in range(2):  # the same prompt twice: its full pages are reused once
            engine.add_request(f"r{i}", prompts[0], SamplingParams(max_new_tokens=2))
            while engine.has_unfinished():
                engine.step()
        state = engine.scheduler.control_state()
        assert state.host_room_bytes == room and state.spills_cached == bool(config)
        full = (len(prompts[0]) - 1) // BASE["page_size"]  # pages of the prompt it shares
        reused = sorted((c.depth, c.hits) for c in state.cached if c.hits)
        assert reused == [(d, 1) for d in range(full)]
        keep = engine.scheduler.controller.decide(state).keep  # the next step's decision
        assert sorted(keep) == sorted(c.page for c in state.cached if c.hits)


def _serve_with_host_rows(model, prompts, reference, **config):
    """Two running rows hold 10 of 14 pages when a higher-ranked third (6) arrives, under the
    joint controller with host-resident rows; checks dense greedy tokens, flat compile
    counts and that no page leaked; returns the engine and each sequence's moves in order
    [('host' | 'device', pages), or ('controller', 0) where the controller chose to_host]."""
    engine = Engine(model, EngineConfig(**BASE, controller="joint", num_host_pages=16,
                                        **config))
    compiles = engine.warmup()
    moves: dict[str, list] = {}
    kv_cache = engine.kv_cache
    for name in ("host", "device"):
        original = getattr(kv_cache, f"to_{name}")

        def move(seq_id, num, original=original, name=name):
            done = original(seq_id, num)
            if done and num > 0:
                moves.setdefault(seq_id, []).append((name, num))
            return done

        setattr(kv_cache, f"to_{name}", move)
    controller = engine.scheduler.control.controller
    decide = controller.decide

    def deciding(state):  # a controller decision shows as a ('controller', 0) move
        d = decide(state)
        for seq_id in d.to_host:
            moves.setdefault(seq_id, []).append(("controller", 0))
        return d

    controller.decide = deciding
    sampling = SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True)
    slo = SLO(ttft_s=60.0, tpot_s=60.0)
    outs = {}
    for i in (0, 1, 2):
        engine.add_request(f"r{i}", prompts[i], sampling, priority=i // 2, slo=slo)
        while i < 2 and engine.scheduler.requests.find(f"r{i}#0").num_computed < len(
                prompts[i]):
            outs.update((int(o.request_id[1:]), o) for o in engine.step())
    while engine.has_unfinished():
        outs.update((int(o.request_id[1:]), o) for o in engine.step())
    assert engine.num_compiles == compiles, "a host move compiled a program"
    host = engine.kv_cache.host_pool
    assert engine.allocator.num_used_pages() == 0 and host.num_free() == host.num_pages
    for i in (0, 1, 2):
        assert outs[i].outputs[0].token_ids == reference[i]
    return engine, moves


def test_joint_controller_moves_a_row_to_the_host_pool_instead_of_preempting(model, prompts,
                                                                              reference):
    """With host-resident rows on (their host attention priced cheap beside the step), the
    joint controller makes room for a higher-ranked arrival by moving a running row's full
    pages to the host pool, where it keeps decoding: nobody is preempted, tokens stay exact."""
    engine, _ = _serve_with_host_rows(model, prompts, reference, host_split="when_full")
    assert engine.stats["controller_to_host"] > 0 and engine.stats["preemptions"] == 0


def test_neo_leaves_a_row_the_controller_moved_to_the_host_until_the_device_has_room(
        model, prompts, reference):
    """Under `neo` with rates at which no row's host attention fits inside the device step
    (2000 tokens/s: 12 tokens already take 6 ms of a 5 ms step), NEO wants every row on the
    device, while a controller that does not price the slowdown (`host_horizon_steps=0`)
    makes room by moving the victim to the host pool. The controller owns that row: NEO
    brings it back only once the device has room for it beyond what the controller moved it
    out for, so every row goes out and comes back at most once (no ping-pong over the link),
    and its tokens, like everyone's, equal the dense reference, with nothing leaked and
    nothing recompiled (`_serve_with_host_rows`)."""
    engine, moves = _serve_with_host_rows(
        model, prompts, reference, host_split="neo",
        host_split_options=dict(host_tokens_per_s=2e3, device_tokens_per_s=1e12,
                                device_step_s=5e-3),
        controller_options=dict(host_horizon_steps=0))
    assert engine.stats["controller_to_host"] > 0 and engine.stats["preemptions"] == 0
    kinds = {seq: "".join(k[0] for k, _ in m) for seq, m in moves.items()}  # c, h, d
    assert "chd" in kinds.values(), kinds  # out for the arrival, back once there is room
    for k in kinds.values():  # out (h) and back (d) at most once each
        assert k.replace("c", "") in ("", "h", "hd"), kinds
