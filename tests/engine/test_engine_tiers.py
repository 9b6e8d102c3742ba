"""Engine with host/disk KV tiers: spilled prefix pages come back without recompute, swaps and
loads survive injected faults, and greedy tokens never change (oracle: `greedy_reference`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvjax import EngineConfig, KVLayout, PreemptionMode, SamplingParams
from kvjax.bench.workloads import multi_turn
from kvjax.engine.engine import Engine
from kvjax.memory.tiers import TierConfig
from kvjax.memory.transfer import Fault, FaultConfig, TransferKind, TransferState
from kvjax.shapes import pages_for
from kvjax.testing import greedy_reference, tiny_model

MAX_NEW = 4
# Few step shapes (one chunk bucket, two decode buckets) keep compilation short.
BASE = dict(page_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_prefill_chunk=16,
            max_prefill_seqs=1, min_chunk_bucket=16, num_pages=20)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def page_bytes(model):
    return model.config.kv_bytes_per_token(model.dtype) * BASE["page_size"]


@pytest.fixture(scope="module")
def chat(model):
    """A conversation whose second turn extends the first, with unrelated traffic between.

    The device pool holds 20 pages; the traffic evicts the first turn's cached pages.
    """
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(0, 120, size=n)]  # noqa: E731
    first = ids(30)
    traffic = [ids(30) for _ in range(4)]
    second = first + ids(6)
    batches = [[first], traffic[:2], traffic[2:], [second]]
    refs = [[greedy_reference(model, p, MAX_NEW) for p in batch] for batch in batches]
    return batches, refs


def serve(model, config, batches, *, warm=False):
    """Runs the batches one after another; returns the engine and each batch's tokens."""
    engine = Engine(model, config)
    if warm:
        engine.warmup()
    compiles = engine.num_compiles
    outs = []
    for batch in batches:
        results = engine.generate(batch, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        outs.append([o.outputs[0].token_ids for o in results])
    if warm:
        assert engine.num_compiles == compiles, "programs compiled after warm-up"
    return engine, outs


def test_spilled_prefix_pages_load_back_instead_of_recomputing(model, chat, page_bytes):
    batches, refs = chat
    plain, plain_out = serve(model, EngineConfig(**BASE), batches)
    tiered, tiered_out = serve(model, EngineConfig(**BASE, tiers=TierConfig(
        host_bytes=64 * page_bytes)), batches, warm=True)
    assert plain_out == refs and tiered_out == refs
    assert plain.stats["bytes_device_to_host"] == 0 and "tier_hit_tokens" in plain.stats
    hit = tiered.stats["tier_hit_tokens"]
    assert hit >= 16, "the second turn should find most of the first turn's pages on the host"
    # Every page loaded is a page not prefilled again.
    assert plain.stats["prefill_tokens"] - tiered.stats["prefill_tokens"] == hit
    assert tiered.stats["bytes_host_to_device"] == hit // BASE["page_size"] * page_bytes
    assert tiered.stats["bytes_device_to_host"] % page_bytes == 0
    assert tiered.stats["bytes_device_to_host"] >= tiered.stats["bytes_host_to_device"]
    assert tiered.tiers.host.used_bytes <= 64 * page_bytes
    assert tiered.allocator.num_used_pages() == 0


@pytest.mark.parametrize("disk_io_threads", [2, 0], ids=["async", "inline"])
def test_disk_tier_serves_pages_the_host_tier_could_not_keep(model, chat, page_bytes, tmp_path,
                                                              disk_io_threads):
    batches, refs = chat
    tiers = TierConfig(host_bytes=4 * page_bytes, disk_bytes=256 * page_bytes,
                       disk_dir=str(tmp_path), disk_io_threads=disk_io_threads)
    engine, out = serve(model, EngineConfig(**BASE, tiers=tiers), batches)
    assert out == refs
    stats = engine.stats
    assert stats["bytes_host_to_disk"] > 0 and stats["bytes_disk_to_host"] > 0
    assert stats["tier_hit_tokens"] >= 16
    assert engine.tiers.host.used_bytes <= 4 * page_bytes
    for _ in range(2):  # idle steps wait for the disk writes still in flight, then commit them
        engine.step()
    assert engine.tiers.num_inflight == 0
    disk = engine.tiers.disk
    files = os.listdir(disk.directory)
    assert os.path.dirname(disk.directory) == str(tmp_path)
    assert sorted(files) == sorted(os.path.basename(disk.path_of(k)) for k in disk.keys())
    assert sum(os.path.getsize(os.path.join(disk.directory, f)) for f in files) == \
        disk.used_bytes <= 256 * page_bytes


def test_corrupted_disk_files_are_never_loaded(model, chat, page_bytes, tmp_path):
    batches, refs = chat
    tiers = TierConfig(host_bytes=2 * page_bytes, disk_bytes=256 * page_bytes,
                       disk_dir=str(tmp_path))
    engine = Engine(model, EngineConfig(**BASE, tiers=tiers))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for batch, ref in zip(batches[:-1], refs[:-1], strict=True):
        assert [o.outputs[0].token_ids for o in engine.generate(batch, params)] == ref
    for _ in range(2):  # idle steps: the disk writes in flight commit before the files go bad
        engine.step()
    disk = engine.tiers.disk
    assert len(disk) > 0 and engine.tiers.num_inflight == 0
    for key in disk.keys():  # flip one payload byte of every page file
        with open(disk.path_of(key), "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    (out,) = engine.generate(batches[-1], params)
    assert out.outputs[0].token_ids == refs[-1][0]
    reads = [t for t in engine.tiers.recent_transfers if t.kind is TransferKind.DISK_TO_HOST]
    assert reads and all(t.state is TransferState.FAILED for t in reads)
    assert all(t.keys[0] not in disk and not os.path.exists(disk.path_of(t.keys[0]))
               for t in reads), "a file that failed its check must be deleted"
    # Only pages still in the host tier (2 pages) could have been loaded.
    assert engine.stats["tier_hit_tokens"] <= 2 * BASE["page_size"]


class ByteTokenizer:
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [b % 120 for b in text.encode()]


def test_multi_turn_chat_with_a_pool_a_quarter_of_the_working_set_finishes(model, page_bytes):
    """Prefetched sequences hold pages while waiting; they must never starve the queue's head.

    The oracle is a plain engine with a pool holding everything (no tiers, no eviction).
    """
    requests = multi_turn(ByteTokenizer(), seed=0, num_requests=18, num_turns=3, user_min=8,
                          user_max=16, answer_len=4, think_time_s=0.0)
    turns = [[list(r.prompt_ids) for r in requests if r.turn == t] for t in range(3)]
    config = {k: v for k, v in BASE.items() if k != "num_pages"} | dict(max_num_seqs=4,
                                                                       max_model_len=96)
    roomy, expected = serve(model, EngineConfig(**config, num_pages=128), turns)
    assert roomy.stats["preemptions"] == 0
    engine = Engine(model, EngineConfig(**config, num_pages=18, tiers=TierConfig(
        host_bytes=128 * page_bytes)))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for batch, want in zip(turns, expected, strict=True):
        for i, prompt in enumerate(batch):
            engine.add_request(f"{len(prompt)}-{i}", prompt, params)
        done, steps = {}, 0
        while engine.has_unfinished():
            steps += 1
            assert steps < 500, "the engine stopped making progress"
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        assert [done[f"{len(p)}-{i}"] for i, p in enumerate(batch)] == want
    assert engine.stats["tier_hit_tokens"] > 0


@pytest.fixture(scope="module")
def pressure(model):
    """Concurrent sequences that outgrow a 12-page pool, so running ones get preempted."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 120, size=int(n))] for n in (14, 9, 17, 6, 12)]
    return prompts, [greedy_reference(model, p, 10) for p in prompts]


PRESSURE = dict(BASE, num_pages=12, max_num_seqs=4)


def run_pressure(model, prompts, config):
    engine = Engine(model, config)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("faults,timeout", [
    (FaultConfig(fail_fraction=0.2, corrupt_fraction=0.2, delay_fraction=0.3, delay_polls=2,
                 seed=3), 8),
    (FaultConfig(fail_fraction=0.1, corrupt_fraction=0.3, delay_fraction=0.4, delay_polls=4,
                 seed=4), 2),
], ids=["late", "timeouts"])
def test_faulty_swaps_fall_back_to_recompute_with_identical_tokens(model, pressure, page_bytes,
                                                                   faults, timeout):
    prompts, refs = pressure
    tiers = TierConfig(host_bytes=64 * page_bytes, faults=faults, timeout_polls=timeout)
    engine, out = run_pressure(model, prompts, EngineConfig(
        **PRESSURE, preemption_mode=PreemptionMode.SWAP, tiers=tiers))
    assert out == refs
    assert engine.stats["swaps_out"] > 0 and engine.stats["swaps_in"] > 0
    counts = engine.tiers.faults.counts
    assert counts[Fault.FAIL] + counts[Fault.CORRUPT] > 0
    assert engine.tiers.stats["transfers_failed"] > 0
    if timeout < faults.delay_polls:
        assert engine.tiers.stats["transfers_timed_out"] > 0
    assert engine.allocator.num_used_pages() == 0
    for _ in range(timeout + 1):  # idle steps still poll: late spills land or time out
        engine.step()
    assert engine.tiers.num_inflight == 0 and engine.tiers.num_loading == 0
    assert not [k for k in engine.tiers.host.keys() if isinstance(k, tuple)], "swap pages leaked"


def test_faulty_tier_loads_fall_back_to_recompute(model, chat, page_bytes, tmp_path):
    batches, refs = chat
    faults = FaultConfig(fail_fraction=0.2, corrupt_fraction=0.3, delay_fraction=0.2,
                         delay_polls=2, seed=7)
    tiers = TierConfig(host_bytes=8 * page_bytes, disk_bytes=256 * page_bytes,
                       disk_dir=str(tmp_path), faults=faults, max_chunk_pages=2)
    # Fault draws follow the order transfers are issued in, and the seed was picked so that
    # every kind of fault reaches the disk in the synchronous order; asynchronous scheduling
    # issues them in another order (its fault handling is covered by the swap cases above).
    engine, out = serve(model, EngineConfig(**BASE, tiers=tiers, async_scheduling=False),
                        batches)
    assert out == refs
    transfers = engine.tiers.recent_transfers
    kinds = {t.kind for t in transfers if t.state is TransferState.FAILED}
    assert len(kinds) >= 2, f"faults should hit several kinds of transfer, hit {kinds}"
    disk_kinds = (TransferKind.HOST_TO_DISK, TransferKind.DISK_TO_HOST)
    disk = [t for t in transfers if t.kind in disk_kinds]
    assert {t.fault for t in disk} == set(Fault), "every fault should hit the disk workers"
    assert any(t.fault is Fault.DELAY and t.state is TransferState.COMMITTED for t in disk)
    for _ in range(3 * (faults.delay_polls + 1)):  # idle steps poll: late transfers land
        if not engine.tiers.num_inflight:
            break
        engine.step()
    assert engine.tiers.num_inflight == 0
    for t in transfers:
        assert t.is_done
        assert t.history[0] is TransferState.QUEUED
        assert (t.state is TransferState.FAILED) == (t.error is not None)
    disk_tier = engine.tiers.disk
    assert sorted(os.listdir(disk_tier.directory)) == sorted(
        os.path.basename(disk_tier.path_of(k)) for k in disk_tier.keys()), "files leaked"
    assert disk_tier.reserved_bytes == 0 and disk_tier.used_bytes <= 256 * page_bytes


def test_auto_preemption_follows_the_cost_model(model, pressure, page_bytes):
    prompts, refs = pressure
    choices = {}
    for name, bandwidth in (("fast_link", 1e15), ("slow_link", 1e-3)):
        tiers = TierConfig(host_bytes=64 * page_bytes, swap_bandwidth_bytes_per_s=bandwidth,
                           recompute_tokens_per_s=1000.0)
        engine, out = run_pressure(model, prompts, EngineConfig(
            **PRESSURE, preemption_mode=PreemptionMode.AUTO, tiers=tiers))
        assert out == refs
        decisions = engine.stats["preemption_decisions"]
        assert len(decisions) == engine.stats["preemptions"] > 0
        for d in decisions:
            tokens = d["num_tokens"]
            assert d["recompute_cost_s"] == pytest.approx(tokens / 1000.0)
            # A swap moves the pages the sequence holds, its tokens rounded up to pages.
            assert d["swap_bytes"] == pages_for(tokens, BASE["page_size"]) * page_bytes
            assert d["swap_cost_s"] == pytest.approx(2 * d["swap_bytes"] / bandwidth)
        choices[name] = {d["choice"] for d in decisions}
        assert engine.stats["swaps_out"] == sum(d["choice"] == "swap" for d in decisions)
    assert choices == {"fast_link": {"swap"}, "slow_link": {"recompute"}}


def test_loading_sequence_is_not_scheduled_before_its_pages_commit(model, chat, page_bytes):
    batches, refs = chat
    faults = FaultConfig(delay_fraction=1.0, delay_polls=3, kinds=(TransferKind.HOST_TO_DEVICE,))
    engine = Engine(model, EngineConfig(**BASE, tiers=TierConfig(
        host_bytes=64 * page_bytes, faults=faults, timeout_polls=10)))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for batch in batches[:-1]:
        engine.generate(batch, params)
    engine.add_request("second", batches[-1][0], params)
    engine.step()  # admits it: the load is issued and polled once, delayed by 3 polls
    assert engine.tiers.is_loading("second#0")
    waited = 0
    while engine.tiers.is_loading("second#0"):
        assert engine.num_running == 0 and not engine.snapshot_outputs()[0].outputs[0].token_ids
        engine.step()
        waited += 1
    assert waited == faults.delay_polls  # it lands on the poll after its delay
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].outputs[0].token_ids == refs[-1][0]
    assert engine.stats["tier_hit_tokens"] >= 16


def test_sequence_due_to_run_joins_the_step_that_loads_its_host_pages(model, chat, page_bytes):
    batches, refs = chat
    engine = Engine(model, EngineConfig(**BASE, tiers=TierConfig(host_bytes=64 * page_bytes)))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for batch in batches[:-1]:
        engine.generate(batch, params)
    engine.add_request("second", batches[-1][0], params)
    prefilled = engine.stats["prefill_tokens"]
    engine.step()  # admits it, loads its pages from the host and runs its first chunk
    assert not engine.tiers.is_loading("second#0") and engine.num_running == 1
    assert engine.stats["tier_hit_tokens"] >= 16 and engine.stats["prefill_tokens"] > prefilled
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].outputs[0].token_ids == refs[-1][0]


def test_tiers_with_scrubbing_and_copy_on_write_stay_exact(model, pressure, page_bytes):
    prompts, refs = pressure
    shared = prompts[2][:12]
    prompts = prompts + [shared + p[:5] for p in prompts[:3]]
    refs = refs + [greedy_reference(model, shared + p[:5], 10) for p in prompts[:3]]
    engine, out = run_pressure(model, prompts, EngineConfig(
        **PRESSURE, scrub_freed_pages=True, tiers=TierConfig(host_bytes=64 * page_bytes)))
    assert out == refs
    assert engine.stats["bytes_device_to_host"] > 0


@pytest.mark.parametrize("overrides,match", [
    (dict(kv_layout=KVLayout.CONTIGUOUS, tiers=TierConfig(host_bytes=1 << 20)), "paged"),
    (dict(tiers=TierConfig(host_bytes=10)), "holds no page"),
])
def test_invalid_tier_configs_raise(model, overrides, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, EngineConfig(**{**BASE, **overrides}))


@pytest.mark.parametrize("kwargs,match", [
    (dict(disk_bytes=100), "needs a host tier"),
    (dict(host_bytes=-1), "host_bytes"),
    (dict(host_bytes=1, timeout_polls=0), "timeout_polls"),
    (dict(host_bytes=1, disk_io_threads=-1), "disk_io_threads"),
    (dict(host_bytes=1, swap_bandwidth_bytes_per_s=0.0), "swap_bandwidth"),
])
def test_tier_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TierConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(fail_fraction=1.5), "fail_fraction"),
    (dict(fail_fraction=0.6, corrupt_fraction=0.6), "sum"),
    (dict(delay_polls=0), "delay_polls"),
])
def test_fault_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultConfig(**kwargs)


def test_async_scheduling_spills_and_loads_like_sync(model, page_bytes):
    """A transfer planned with no step in flight (a batch's first step) is reported before the
    next step is planned, so asynchronous scheduling finds the same tier hits as synchronous
    and about as many steps (each batch starts with nothing in flight)."""
    rng = np.random.default_rng(1)
    ids = lambda n: [int(t) for t in rng.integers(0, 120, size=n)]  # noqa: E731
    firsts = [ids(30) for _ in range(2)]
    batches = [firsts, [ids(30) for _ in range(2)], [f + ids(6) for f in firsts]]
    runs = {}
    for mode in (False, True):
        runs[mode] = serve(model, EngineConfig(**BASE, async_scheduling=mode, tiers=TierConfig(
            host_bytes=64 * page_bytes)), batches)
    (sync, sync_out), (overlap, overlap_out) = runs[False], runs[True]
    assert overlap_out == sync_out
    assert sync.stats["tier_hit_tokens"] >= 16
    assert overlap.stats["tier_hit_tokens"] == sync.stats["tier_hit_tokens"]
    assert abs(overlap.stats["steps"] - sync.stats["steps"]) <= 2
