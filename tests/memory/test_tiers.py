"""Tier transfers: the state machine, checksums, faults, budgets and LRU order, checked against
brute-force models (Python-int checksums, a dict of what each key must hold, the files on disk)."""

from __future__ import annotations

import os
import tempfile
import threading

import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvjax.kv.state import PagedKV
from kvjax.memory.tiers import (
    TierConfig,
    TierManager,
    TransferLayout,
    measure_transfer_bandwidth,
)
from kvjax.memory.tiers import disk as disk_module
from kvjax.memory.transfer import (
    Fault,
    FaultConfig,
    FaultInjector,
    IllegalTransition,
    Transfer,
    TransferKind,
    TransferState,
    is_legal_transition,
    page_checksums,
    page_checksums_np,
)

S = TransferState
NUM_PAGES = 8
PAGE_SHAPE = (2, 2, 1, 2)  # per leaf: [L, P, K, D]
PAGE_BYTES = 2 * 4 * int(np.prod(PAGE_SHAPE))  # K and V, float32


def random_kv(seed: int) -> PagedKV:
    rng = np.random.default_rng(seed)
    shape = (PAGE_SHAPE[0], NUM_PAGES, *PAGE_SHAPE[1:])
    return PagedKV(k_pages=jnp.asarray(rng.normal(size=shape), jnp.float32),
                   v_pages=jnp.asarray(rng.normal(size=shape), jnp.float32))


def page_of(kv: PagedKV, page: int) -> list[np.ndarray]:
    return [np.asarray(kv.k_pages)[:, page], np.asarray(kv.v_pages)[:, page]]


# ----------------------------------------------------------------------------- state machine


def test_transfer_walks_only_the_legal_path():
    t = Transfer(TransferKind.DEVICE_TO_HOST, ("a",), 8)
    with pytest.raises(IllegalTransition):
        t.advance(S.LANDED)  # skips IN_FLIGHT
    with pytest.raises(IllegalTransition, match="only committed"):
        t.result()
    for state in (S.IN_FLIGHT, S.LANDED, S.VERIFIED):
        t.advance(state)
        with pytest.raises(IllegalTransition):
            t.result()
    t.payload = "data"
    t.advance(S.COMMITTED)
    assert t.result() == "data" and t.is_done
    assert t.history == [S.QUEUED, S.IN_FLIGHT, S.LANDED, S.VERIFIED, S.COMMITTED]
    with pytest.raises(IllegalTransition):
        t.fail("too late")
    with pytest.raises(IllegalTransition):
        t.advance(S.VERIFIED)


@pytest.mark.parametrize("stop", [S.QUEUED, S.IN_FLIGHT, S.LANDED, S.VERIFIED])
def test_any_unfinished_transfer_can_fail_and_then_holds_nothing(stop):
    t = Transfer(TransferKind.HOST_TO_DEVICE, ("a",), 8, payload="data")
    for state in (S.IN_FLIGHT, S.LANDED, S.VERIFIED)[:list(S).index(stop)]:
        t.advance(state)
    t.fail("boom")
    assert t.state is S.FAILED and t.error == "boom" and t.payload is None and t.is_done
    with pytest.raises(IllegalTransition):
        t.result()
    with pytest.raises(IllegalTransition):
        t.advance(S.COMMITTED)


def test_legal_transitions_form_the_documented_chain():
    chain = [S.QUEUED, S.IN_FLIGHT, S.LANDED, S.VERIFIED, S.COMMITTED]
    for src in S:
        for dst in S:
            expected = (src in chain[:-1] and dst is chain[chain.index(src) + 1]) or (
                dst is S.FAILED and src not in (S.COMMITTED, S.FAILED))
            assert is_legal_transition(src, dst) == expected, (src, dst)


# ----------------------------------------------------------------------------- checksums


def checksum_brute_force(leaves: list[np.ndarray]) -> list[int]:
    """Python-int arithmetic over each page's words, in the documented order."""
    n = leaves[0].shape[1]
    out = []
    for i in range(n):
        total = 0
        for x in leaves:
            words = np.asarray(x[:, i]).reshape(-1).view(f"<u{x.dtype.itemsize}")
            leaf = sum(int(w) * (2 * j + 1) for j, w in enumerate(words)) % 2**32
            total = (total * 0x01000193 + leaf) % 2**32
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.uint8, np.int32])
def test_checksums_match_brute_force_on_device_and_host(dtype):
    rng = np.random.default_rng(0)
    leaves = [(rng.normal(size=(2, 3, 4, 3)) * 50).astype(dtype),
              (rng.normal(size=(2, 3, 5)) * 50).astype(dtype)]
    expected = checksum_brute_force(leaves)
    assert page_checksums_np(leaves).tolist() == expected
    assert np.asarray(page_checksums([jnp.asarray(x) for x in leaves])).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 * 3 * 4 * 4 - 1), st.integers(1, 255), st.integers(0, 2**31))
def test_checksum_catches_any_single_byte_change(position, flip, seed):
    x = np.random.default_rng(seed).normal(size=(2, 3, 4)).astype(np.float32)
    y = x.copy()
    y.reshape(-1).view(np.uint8)[position] ^= flip
    page = (position // 4) // 4 % 3  # the page (axis 1) the changed byte belongs to
    before, after = page_checksums_np([x]), page_checksums_np([y])
    assert before[page] != after[page]
    assert np.array_equal(np.delete(before, page), np.delete(after, page))


def test_fault_injector_hits_the_configured_fractions_reproducibly():
    config = FaultConfig(fail_fraction=0.1, corrupt_fraction=0.2, delay_fraction=0.3, seed=5)
    injector = FaultInjector(config)
    draws = [injector.draw(TransferKind.HOST_TO_DEVICE) for _ in range(20000)]
    for fault, fraction in ((Fault.FAIL, 0.1), (Fault.CORRUPT, 0.2), (Fault.DELAY, 0.3),
                            (Fault.NONE, 0.4)):
        assert abs(draws.count(fault) / len(draws) - fraction) < 0.015
        assert injector.counts[fault] == draws.count(fault)
    again = FaultInjector(config)
    assert [again.draw(TransferKind.HOST_TO_DEVICE) for _ in range(200)] == draws[:200]
    only_disk = FaultInjector(FaultConfig(fail_fraction=1.0, kinds=(TransferKind.HOST_TO_DISK,)))
    assert only_disk.draw(TransferKind.DEVICE_TO_HOST) is Fault.NONE
    assert only_disk.draw(TransferKind.HOST_TO_DISK) is Fault.FAIL
    data = np.arange(16, dtype=np.float32)
    (bad,) = injector.corrupt([data])
    diff = np.flatnonzero(bad.view(np.uint8) != data.view(np.uint8))
    assert len(diff) == 1 and np.array_equal(data, np.arange(16, dtype=np.float32))


# ----------------------------------------------------------------------------- manager


def make_manager(**kwargs) -> TierManager:
    return TierManager(TierConfig(**kwargs), random_kv(0))


def settle(tm: TierManager, kv):
    """One poll after the data of every transfer in flight has landed."""
    tm.block_until_landed()
    return tm.poll(kv)


@pytest.mark.parametrize("layout,num_pages,sizes", [
    (TransferLayout.PAGE_FIRST, 7, [4, 2, 1]),
    (TransferLayout.PAGE_FIRST, 8, [4, 4]),  # host budget of 6 pages caps chunks at 4
    (TransferLayout.PER_PAGE, 3, [1, 1, 1]),
])
def test_pages_travel_in_power_of_two_chunks_or_one_by_one(layout, num_pages, sizes):
    kv = random_kv(1)
    tm = make_manager(host_bytes=6 * PAGE_BYTES, disk_bytes=0, transfer_layout=layout)
    tm.spill(kv, [(f"k{i}", i) for i in range(num_pages)])
    assert [len(t.keys) for t in tm.recent_transfers] == sizes
    assert tm.stats["bytes_device_to_host"] == num_pages * PAGE_BYTES
    kv, _ = settle(tm, kv)
    assert all(t.state is S.COMMITTED for t in tm.recent_transfers)


def test_host_tier_evicts_least_recently_used_pages_to_disk_then_drops():
    kv = random_kv(2)
    with tempfile.TemporaryDirectory() as d:
        disk_files = 2
        tm = make_manager(host_bytes=2 * PAGE_BYTES, disk_dir=d,
                          disk_bytes=disk_files * (PAGE_BYTES + 40), max_chunk_pages=1)
        for i in range(2):
            tm.spill(kv, [(f"k{i}", i)])
        kv, _ = settle(tm, kv)
        tm.load("touch", ["k0"], [7])  # k0 becomes the most recently used
        kv, _ = settle(tm, kv)
        for i in range(2, 5):
            tm.spill(kv, [(f"k{i}", i)])
            kv, _ = settle(tm, kv)
        assert tm.host.keys() == ["k3", "k4"]
        # k2's write is still on the worker: it took k1's room, and k2 loads from its source.
        assert tm.disk.keys() == ["k0"] and tm.num_inflight == 1 and tm.lookup(["k2"]) == 1
        kv, _ = settle(tm, kv)
        assert tm.disk.keys() == ["k0", "k2"]  # k1 went to disk first, then was dropped
        assert tm.stats["pages_dropped"] == 1
        assert tm.lookup(["k0", "k1"]) == 1 and tm.lookup(["k2", "k3", "k4"]) == 3
        tm.close()
        assert os.listdir(d) == []


def test_page_file_is_indexed_only_once_its_write_commits_and_a_torn_file_never(
        tmp_path, monkeypatch):
    gate = threading.Event()
    write = disk_module._write_page_file

    def held_write(*args):
        assert gate.wait(10)
        return write(*args)

    monkeypatch.setattr(disk_module, "_write_page_file", held_write)
    kv = random_kv(8)
    tm = make_manager(host_bytes=PAGE_BYTES, disk_bytes=4 * (PAGE_BYTES + 40),
                      disk_dir=str(tmp_path), max_chunk_pages=1)
    tm.spill(kv, [("a", 0)])
    kv, _ = settle(tm, kv)
    tm.spill(kv, [("b", 1)])
    kv, _ = settle(tm, kv)  # "b" lands on the host and evicts "a" to the (held) disk worker
    (write_a,) = [t for t in tm.recent_transfers if t.kind is TransferKind.HOST_TO_DISK]
    assert write_a.state is S.IN_FLIGHT and "a" not in tm.disk
    assert not os.path.exists(tm.disk.path_of("a"))
    assert tm.disk.reserved_bytes == tm.disk.file_bytes
    # Meanwhile a load takes the page from the write's source, as the host tier held it.
    assert tm.load("x", ["a"], [5]) == 1
    kv, (result,) = tm.poll(kv, owner="x")  # waits for the load's data, not for the write
    assert result.num_loaded == 1
    assert all(np.array_equal(a, b) for a, b in zip(page_of(kv, 5), page_of(random_kv(8), 0),
                                                    strict=True))
    before = np.asarray(kv.k_pages).copy()
    gate.set()
    kv, _ = settle(tm, kv)
    assert write_a.state is S.COMMITTED and tm.lookup(["a"]) == 1
    assert os.listdir(tm.disk.directory) == [os.path.basename(tm.disk.path_of("a"))]
    with open(tm.disk.path_of("a"), "r+b") as f:  # a crash tore the file in half
        f.truncate(tm.disk.file_bytes // 2)
    assert tm.load("y", ["a"], [5]) == 1
    kv, (result,) = settle(tm, kv)
    assert result.num_loaded == 0 and "a" not in tm.disk and os.listdir(tm.disk.directory) == []
    assert np.array_equal(np.asarray(kv.k_pages), before), "nothing may be scattered"
    tm.close()


def test_delayed_transfer_lands_late_or_times_out():
    kv = random_kv(3)
    late = make_manager(host_bytes=8 * PAGE_BYTES, timeout_polls=5,
                        faults=FaultConfig(delay_fraction=1.0, delay_polls=2))
    late.spill(kv, [("a", 0)])
    for _ in range(2):
        kv, _ = settle(late, kv)
        assert late.lookup(["a"]) == 0 and late.num_inflight == 1
    kv, _ = settle(late, kv)
    assert late.lookup(["a"]) == 1
    lost = make_manager(host_bytes=8 * PAGE_BYTES, timeout_polls=1,
                        faults=FaultConfig(delay_fraction=1.0, delay_polls=2))
    lost.spill(kv, [("a", 0)])
    kv, _ = settle(lost, kv)
    kv, _ = settle(lost, kv)
    (t,) = lost.recent_transfers
    assert t.state is S.FAILED and "timed out" in t.error and lost.lookup(["a"]) == 0


@pytest.mark.parametrize("kind", [TransferKind.DEVICE_TO_HOST, TransferKind.HOST_TO_DEVICE])
def test_corrupted_transfer_is_caught_and_never_committed(kind):
    kv = random_kv(4)
    tm = make_manager(host_bytes=8 * PAGE_BYTES,
                      faults=FaultConfig(corrupt_fraction=1.0, kinds=(kind,)))
    tm.spill(kv, [("a", 0), ("b", 1)])
    kv, _ = settle(tm, kv)
    before = np.asarray(kv.k_pages).copy()
    loaded = tm.load("s", ["a", "b"], [5, 6]) if tm.lookup(["a", "b"]) == 2 else 0
    kv, results = settle(tm, kv)
    failed = [t for t in tm.recent_transfers if t.state is S.FAILED]
    assert len(failed) == 1 and failed[0].kind is kind and "checksum" in failed[0].error
    if kind is TransferKind.HOST_TO_DEVICE:
        assert loaded == 2 and results[0].num_loaded == 0
        assert np.array_equal(np.asarray(kv.k_pages), before), "nothing may be scattered"
    else:
        assert tm.lookup(["a"]) == 0


def test_swap_round_trip_and_drop():
    kv = random_kv(5)
    tm = make_manager(host_bytes=8 * PAGE_BYTES)
    nbytes = tm.swap_out(kv, "seq", [3, 1, 4], cache_key=b"salt")
    assert nbytes == 3 * PAGE_BYTES and tm.swap_pending("seq")
    kv, _ = settle(tm, kv)
    keys = tm.swap_keys("seq")
    assert tm.swap_cache_key("seq") == b"salt" and tm.lookup(keys) == 3
    expected = [page_of(kv, p) for p in (3, 1, 4)]
    tm.load("seq", keys, [0, 2, 5])
    kv, (result,) = settle(tm, kv)
    assert result.num_loaded == 3
    for page, want in zip([0, 2, 5], expected, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(page_of(kv, page), want, strict=True))
    tm.drop("seq")
    assert len(tm.host) == 0 and tm.host.used_bytes == 0 and tm.swap_keys("seq") == []


def test_warmup_compiles_every_chunk_size_and_keeps_the_pool():
    kv = random_kv(7)
    before = page_of(kv, slice(None))
    tm = make_manager(host_bytes=8 * PAGE_BYTES, max_chunk_pages=4)
    kv = tm.warmup(kv)
    assert all(np.array_equal(a, b) for a, b in zip(page_of(kv, slice(None)), before,
                                                    strict=True))
    compiled = tm.num_compiles
    tm.spill(kv, [(f"k{i}", i) for i in range(7)])
    kv, _ = settle(tm, kv)
    tm.load("s", [f"k{i}" for i in range(7)], [7, 6, 5, 4, 3, 2, 1])
    kv, (result,) = settle(tm, kv)
    assert result.num_loaded == 7 and tm.num_compiles == compiled


@pytest.mark.parametrize("layout", list(TransferLayout))
def test_bandwidth_measurement_moves_the_requested_pages(layout):
    rates = measure_transfer_bandwidth(random_kv(6), 4, layout, repeats=1)
    assert rates["bytes"] == 4 * PAGE_BYTES
    assert rates["device_to_host_bytes_per_s"] > 0 and rates["host_to_device_bytes_per_s"] > 0


# ----------------------------------------------------------------------------- stateful


class TierMachine(RuleBasedStateMachine):
    """Random spills, swaps, loads, polls, cancels and disk corruption against a model of what
    every key must hold; faults are injected into every kind of transfer, disk I/O runs inline
    or on worker threads."""

    @initialize(host_pages=st.integers(1, 5), disk_pages=st.sampled_from([0, 2, 6]),
                layout=st.sampled_from(list(TransferLayout)),
                faults=st.sampled_from([(0, 0, 0), (0.2, 0.2, 0.2), (0.4, 0.3, 0.3)]),
                delay=st.integers(1, 3), timeout=st.integers(1, 4), seed=st.integers(0, 99),
                disk_threads=st.sampled_from([0, 2]))
    def setup(self, host_pages, disk_pages, layout, faults, delay, timeout, seed, disk_threads):
        self.dir = tempfile.TemporaryDirectory()
        fail, corrupt, late = faults
        self.config = TierConfig(
            host_bytes=host_pages * PAGE_BYTES, disk_bytes=disk_pages * (PAGE_BYTES + 40),
            disk_dir=self.dir.name, disk_io_threads=disk_threads, transfer_layout=layout,
            timeout_polls=timeout,
            faults=FaultConfig(fail_fraction=fail, corrupt_fraction=corrupt,
                               delay_fraction=late, delay_polls=delay, seed=seed))
        self.kv = random_kv(seed)
        self.tm = TierManager(self.config, self.kv)
        self.content: dict = {}  # key -> the page content it must hold
        self.corrupted: set = set()
        self.loads: dict = {}  # owner -> (keys, pages) issued
        self.counter = 0

    def teardown(self):
        if hasattr(self, "tm"):
            self.tm.close()
            self.dir.cleanup()

    def _busy_pages(self) -> set[int]:
        return {p for _, pages, _ in self.loads.values() for p in pages}

    @rule(page=st.integers(0, NUM_PAGES - 1), seed=st.integers(0, 2**16))
    def device_writes(self, page, seed):
        if page in self._busy_pages():
            return
        value = np.random.default_rng(seed).normal(size=PAGE_SHAPE).astype(np.float32)
        self.kv = self.kv.replace(k_pages=self.kv.k_pages.at[:, page].set(value),
                                  v_pages=self.kv.v_pages.at[:, page].set(-value))

    @rule(pages=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
    def spill(self, pages):
        new = [f"k{self.counter + i}" for i in range(len(pages))]
        self.counter += len(pages)
        for key, page in zip(new, pages, strict=True):
            self.content[key] = page_of(self.kv, page)
        self.tm.spill(self.kv, list(zip(new, pages, strict=True)))
        self._poll_once()  # the engine polls at its next step

    @rule(pages=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=3, unique=True),
          seq=st.sampled_from(["s0", "s1"]))
    def swap_out(self, pages, seq):
        if seq in self.loads:
            return
        self.tm.swap_out(self.kv, seq, pages)
        for key, page in zip(self.tm.swap_keys(seq), pages, strict=True):
            self.content[key] = page_of(self.kv, page)
        self._poll_once()

    @rule(seq=st.sampled_from(["s0", "s1"]))
    def drop(self, seq):
        self.tm.drop(seq)
        self.loads.pop(seq, None)

    @rule(owner=st.sampled_from(["a", "b", "a", "b", "s0", "s1"]), data=st.data())
    def load(self, owner, data):
        if owner in self.loads:
            return
        if owner.startswith("s"):
            keys = self.tm.swap_keys(owner)
        else:
            stored = [k for k in self.tm.host.keys() + (self.tm.disk.keys() if self.tm.disk
                                                       else []) if isinstance(k, str)]
            if not stored:
                return
            start = int(data.draw(st.sampled_from(stored))[1:])
            keys = [f"k{i}" for i in range(start, min(start + 4, self.counter))]
        free = [p for p in range(NUM_PAGES) if p not in self._busy_pages()]
        keys = keys[:len(free)]
        pages = data.draw(st.permutations(free))[:len(keys)]
        issued = self.tm.load(owner, keys, pages)
        assert issued <= len(keys)
        if issued:
            self.loads[owner] = (keys[:issued], pages[:issued], set(self.corrupted))

    @rule(owner=st.sampled_from(["a", "b"]))
    def cancel(self, owner):
        self.tm.cancel(owner)
        self.loads.pop(owner, None)

    @precondition(lambda self: self.tm.disk is not None
                  and set(self.tm.disk.keys()) - self.corrupted)
    @rule(data=st.data())
    def corrupt_disk_file(self, data):
        self.tm.block_until_landed()  # reads in flight see the file before or after, not both
        intact = [k for k in self.tm.disk.keys() if k not in self.corrupted]
        key = data.draw(st.sampled_from(intact))
        with open(self.tm.disk.path_of(key), "r+b") as f:
            f.seek(data.draw(st.integers(0, self.tm.disk.file_bytes - 1)))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        self.corrupted.add(key)

    @rule(times=st.integers(1, 4))
    def poll(self, times):
        for _ in range(times):
            self._poll_once()

    def _poll_once(self):
        # Waiting keeps runs deterministic; injected delays still leave transfers in flight.
        self.tm.block_until_landed()
        self.kv, results = self.tm.poll(self.kv)
        for result in results:
            keys, pages, corrupted = self.loads.pop(result.owner)
            assert result.num_issued == len(keys) and result.num_loaded <= len(keys)
            for key, page in zip(keys[:result.num_loaded], pages, strict=False):
                assert key not in corrupted, "a corrupted disk file was loaded"
                got = page_of(self.kv, page)
                assert all(np.array_equal(a, b) for a, b in zip(got, self.content[key],
                                                                strict=True))

    def _disk_writes_in_flight(self) -> list[Transfer]:
        return [t for t in self.tm.recent_transfers
                if t.kind is TransferKind.HOST_TO_DISK and not t.is_done]

    @invariant()
    def budgets_hold(self):
        assert self.tm.host.used_bytes <= self.config.host_bytes
        if self.tm.disk is not None:
            disk = self.tm.disk
            assert disk.used_bytes + disk.reserved_bytes <= self.config.disk_bytes
            assert disk.reserved_bytes == len(self._disk_writes_in_flight()) * disk.file_bytes

    @invariant()
    def no_transfer_is_left_behind(self):
        assert sum(not t.is_done for t in self.tm.recent_transfers) == self.tm.num_inflight

    @invariant()
    def files_on_disk_are_the_index_and_the_writes_in_flight(self):
        if self.tm.disk is None:
            return
        disk = self.tm.disk
        self.tm.block_until_landed()  # abandoned writes' temporary files are gone after it
        files = set(os.listdir(disk.directory))
        pages = {f for f in files if f.endswith(".kvpage")}
        assert pages == {os.path.basename(disk.path_of(k)) for k in disk.keys()}
        assert sum(os.path.getsize(os.path.join(disk.directory, f)) for f in pages) == \
            disk.used_bytes
        writing = self._disk_writes_in_flight()
        assert files - pages == {f"{os.path.basename(disk.path_of(t.keys[0]))}."
                                 f"{t.transfer_id}.tmp" for t in writing}
        assert not {t.keys[0] for t in writing} & set(disk.keys()), "indexed before committed"

    @invariant()
    def stored_pages_hold_what_was_spilled(self):
        for key in self.tm.host.keys():
            assert all(np.array_equal(a, b) for a, b in
                       zip(self.tm.host.peek(key), self.content[key], strict=True))
        if self.tm.disk is not None:
            for key in self.tm.disk.keys():
                page = self.tm.disk.inspect(key)
                assert (page is None) == (key in self.corrupted)
                if page is not None:
                    assert all(np.array_equal(a, b) for a, b in
                               zip(page, self.content[key], strict=True))

    @invariant()
    def transfers_follow_the_state_machine(self):
        committed_keys, written_keys = set(), set()
        for t in self.tm.recent_transfers:
            assert t.history[0] is S.QUEUED and t.history[-1] is t.state
            for a, b in zip(t.history, t.history[1:], strict=False):
                assert is_legal_transition(a, b)
            assert (t.state is S.FAILED) == (t.error is not None)
            if t.kind is TransferKind.DEVICE_TO_HOST and t.state is S.COMMITTED:
                committed_keys.update(t.keys)
            if t.kind is TransferKind.HOST_TO_DISK and t.state is S.COMMITTED:
                written_keys.update(t.keys)
        stored = set(self.tm.host.keys()) | set(self.tm.disk.keys() if self.tm.disk else [])
        assert stored <= committed_keys, "only committed pages may be readable"
        assert set(self.tm.disk.keys() if self.tm.disk else []) <= written_keys, \
            "only committed page files may be readable"


TierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_tier_state_machine = TierMachine.TestCase
