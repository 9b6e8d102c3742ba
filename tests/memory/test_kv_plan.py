"""KV operations as data: copy-on-write copies, scrubs and KIVI window copies issued while a
step is formed leave the pool untouched and come back as index arrays; applying them gives the
pool exactly what applying each op when issued gives (the oracle: a second manager that
does)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from test_kv_cache_manager import CONFIG, P, make_manager, page

import kvjax
from kvjax.engine.residual import WindowBlockManager, WindowSwapSpace
from kvjax.engine.runner import StepObserver
from kvjax.kv import quantized
from kvjax.kv.retention import RetentionManager, make_retention
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import DATA_KINDS, HostKV, KVOpKind
from kvjax.testing import greedy_reference, tiny_model


def _fork_write_free(manager) -> list[int]:
    """a's prompt, b forked from it and writing into the shared partial page (a copy), then a
    freed (a scrub of the page only it held), then c taking a page; returns a's table."""
    manager.lookup("a", [1, 2, 3, 4, 5, 6], b"")
    assert manager.allocate("a", 0, 6)
    table = manager.block_table("a")
    assert manager.fork("a", "b")
    assert manager.allocate("b", 6, 8)
    manager.free("a")
    manager.lookup("c", [9, 9, 9], b"")
    assert manager.allocate("c", 0, 3)
    return table


def _pool(device) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(device.kv.k_pages), np.asarray(device.kv.v_pages)


def test_planned_copies_and_scrubs_apply_to_the_same_pool_as_immediate_ones():
    planned, planned_device = make_manager(scrub=True)
    immediate, immediate_device = make_manager(scrub=True)
    before = _pool(planned_device)
    planned.defer_ops()
    table = _fork_write_free(planned)
    _fork_write_free(immediate)
    # Nothing reached the device while the step was formed.
    for got, want in zip(_pool(planned_device), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not [op for op in planned_device.ops if op.kind in DATA_KINDS]
    plan = planned.take_plan()
    assert [op.kind for op in plan] == [KVOpKind.COPY, KVOpKind.SCRUB]
    copy, scrub = plan
    assert copy.src == (table[-1],) and copy.dst == copy.pages == (planned.block_table("b")[-1],)
    assert scrub.pages == (table[-1],) and scrub.dst == scrub.pages  # b holds the first page
    assert planned.take_ops() == immediate.take_ops()  # the same record either way
    planned_device.apply_ops(plan)
    for got, want in zip(_pool(planned_device), _pool(immediate_device), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not page(planned_device, table[-1]).any()


def _fork_with_a_planned_copy():
    """b forked from a and writing into their shared partial page while a step is formed (a
    copy into b's own last page, planned); the device's record is cleared."""
    manager, device = make_manager(num_pages=8, scrub=True)
    manager.lookup("a", list(range(1, 7)), b"")
    assert manager.allocate("a", 0, 6)
    assert manager.fork("a", "b")
    manager.defer_ops()
    assert manager.allocate("b", 6, 7)
    device.ops.clear()
    return manager, device


def test_an_op_that_runs_now_first_applies_the_ops_planned_before_it():
    manager, device = _fork_with_a_planned_copy()
    # A snapshot's pages are written when issued (a closure): the copy must land first.
    assert manager.returning.place("c", [9, 9, 9], 3, b"", "v0", 1, lambda kv, tables, first: kv)
    assert [op.kind for op in device.ops] == [KVOpKind.COPY, KVOpKind.SCATTER]
    assert manager.take_plan() == ()


def test_a_planned_swap_out_reads_the_pages_after_the_copy_and_before_the_scrub():
    manager, device = _fork_with_a_planned_copy()
    table = manager.block_table("b")
    manager.swap_out("b", 7)  # reads b's pages, then frees (scrubs) its own
    assert device.ops == []  # nothing ran: the swap is data in the step's plan
    plan = manager.take_plan()
    assert [op.kind for op in plan] == [KVOpKind.COPY, KVOpKind.SWAP_OUT, KVOpKind.SCRUB]
    copy, swap_out, scrub = plan
    assert swap_out.pages == tuple(table) and copy.dst[0] == table[-1] in scrub.pages
    device.apply_ops(plan)
    expected = [page(device, p).copy() for p in manager.block_table("a")]  # b's own: a's copy
    assert not page(device, table[-1]).any()  # scrubbed after the copy was taken
    assert manager.swap_in("b", list(range(1, 8)), 7, b"other-key", "v0")
    for p, want in zip(manager.block_table("b"), expected, strict=True):
        np.testing.assert_array_equal(page(device, p), want)


def test_outside_a_step_ops_apply_when_issued():
    manager, device = make_manager(scrub=True)
    manager.defer_ops()
    assert manager.take_plan() == ()
    manager.lookup("a", [1, 2, 3, 4, 5], b"")
    assert manager.allocate("a", 0, 5)
    table = manager.block_table("a")
    manager.free("a")
    assert device.ops[-1].kind is KVOpKind.SCRUB
    assert not any(page(device, p).any() for p in table)


class _Events(StepObserver):
    """The runner's KV ops and steps, in the order it ran them."""

    def __init__(self):
        self.events: list[str] = []
        self.ops = []

    def before_step(self, shape, host_input) -> None:
        self.events.append("step")

    def on_kv_op(self, op) -> None:
        self.events.append(op.kind.value)
        self.ops.append(op)


def test_engine_applies_each_steps_plan_in_its_dispatch_and_keeps_greedy_tokens():
    """n = 2 samples share the prompt's last partial page; each one's first decode copies it
    (planned while the step is formed, applied by the runner right before that step's model).
    Scrubbing freed pages changes no token."""
    model = tiny_model()
    prompt = [5, 9, 3, 7, 11, 2]
    engine = kvjax.Engine(model, kvjax.EngineConfig(
        page_size=4, num_pages=32, max_num_seqs=4, scrub_freed_pages=True))
    events = _Events()
    engine.add_step_observer(events)
    plans = []  # (the step's plan, whether it ran a step)
    schedule = engine.scheduler.schedule

    def recording_schedule(**kwargs):
        so = schedule(**kwargs)
        plans.append(([op.kind.value for op in so.kv_plan], not so.is_empty))
        return so

    engine.scheduler.schedule = recording_schedule
    engine.add_request("r", prompt, kvjax.SamplingParams(max_new_tokens=6, n=2))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert any("copy" in plan for plan, _ in plans), plans
    # The ops the runner ran before each step end with that step's plan.
    before_step = " ".join(events.events).split("step")[:-1]
    stepped = [plan for plan, runs in plans if runs]
    assert len(before_step) == len(stepped)
    for ops, plan in zip(before_step, stepped, strict=True):
        assert ops.split()[len(ops.split()) - len(plan):] == plan
    want = greedy_reference(model, prompt, 6)
    (out,) = finished
    assert [o.token_ids for o in out.outputs] == [want, want]
    # The samples' own pages were freed as they finished (planned while committing their
    # last step) and zeroed before anything could read the pool.
    last_scrub = [op for op in events.ops if op.kind is KVOpKind.SCRUB and op.pages][-1]
    assert not np.asarray(engine.kv.k_pages[:, list(last_scrub.pages)]).any()
    assert not np.asarray(engine.kv.v_pages[:, list(last_scrub.pages)]).any()


def _kivi_manager():
    """A KIVI pool whose window slot s holds the value s + 1 everywhere, so a copied or zeroed
    window shows."""
    kv = quantized.init_quantized_kv(CONFIG, 8, P, "kivi4", num_seq_slots=3, group=4,
                                     residual=4)
    kv = kv.with_seq_slot_leaves([
        x + jnp.arange(1, 4, dtype=x.dtype).reshape(1, 3, *[1] * (x.ndim - 2))
        for x in kv.seq_slot_leaves()])
    allocator = WindowBlockManager(8, P, num_seq_slots=3, scrub_windows=True)
    device = HostKV(kv)
    manager = KVCacheManager(device, allocator, WindowSwapSpace(allocator),
                             RetentionManager(make_retention("none", None, P)), page_size=P,
                             watermark=0.0, scrub_freed_pages=True, stats={})
    return manager, device


def _windows(device) -> list[np.ndarray]:
    return [np.asarray(x) for x in device.kv.seq_slot_leaves()]


def test_planned_window_copy_and_window_scrub_match_immediate_ones():
    planned, planned_device = _kivi_manager()
    immediate, immediate_device = _kivi_manager()
    for manager in (planned, immediate):
        manager.lookup("a", [1, 2, 3, 4, 5], b"")
        assert manager.allocate("a", 0, 5)
    before = _windows(planned_device)
    planned.defer_ops()
    for manager in (planned, immediate):
        assert manager.fork("a", "b")
        manager.free("a")
    for got, want in zip(_windows(planned_device), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing applied yet
    plan = planned.take_plan()
    kinds = [op.kind for op in plan]
    assert KVOpKind.COPY_WINDOW in kinds and kinds[-1] is KVOpKind.SCRUB
    (copy,) = [op for op in plan if op.kind is KVOpKind.COPY_WINDOW]
    a_slot, b_slot = copy.src[0], copy.dst[0]
    assert plan[-1].seq_slots == (a_slot,)  # a's window is scrubbed with it
    planned_device.apply_ops(plan)
    for got, want in zip(_windows(planned_device), _windows(immediate_device), strict=True):
        np.testing.assert_array_equal(got, want)
    for x, old in zip(_windows(planned_device), before, strict=True):
        np.testing.assert_array_equal(x[:, b_slot], old[:, a_slot])  # b starts from a's window
        assert not x[:, a_slot].any()


def test_a_slot_an_unwritten_registration_gave_back_is_not_scrubbed_under_its_next_owner():
    """A registration that falls through (a swap-in with no room) gives its window slot back
    unwritten; the sequence that takes the slot next keeps its window through later scrubs
    (each scrub zeroes the slots freed since the last one, none twice)."""
    manager, device = _kivi_manager()
    manager.lookup("c", [1, 2, 3], b"")
    manager.lookup("a", [4, 5, 6], b"")
    slot = manager.seq_slot("a")
    manager.unregister("a")  # no scrub: nothing was written
    manager.lookup("b", [7, 8, 9], b"")
    assert manager.seq_slot("b") == slot
    before = _windows(device)
    c_slot = manager.seq_slot("c")
    manager.free("c")
    (scrub,) = [op for op in device.ops if op.kind is KVOpKind.SCRUB]
    assert scrub.seq_slots == (c_slot,)
    for x, old in zip(_windows(device), before, strict=True):
        np.testing.assert_array_equal(x[:, slot], old[:, slot])
        assert not x[:, c_slot].any()


def test_a_window_swapped_through_the_tiers_travels_as_data_into_its_new_slot():
    """With tiers on, a KIVI sequence's swap-out plans its pages as tier spills and its window
    as a SWAP_OUT of no pages (before the scrub of its slot); registered again, a SWAP_IN of no
    pages writes the window into its new slot. Applied from the data alone, the new slot holds
    the old window and the old slot is zeroed."""
    from kvjax.memory.tiers import PlannedTierPort, TierConfig, TieredSwapSpace, TierManager

    manager, device = _kivi_manager()
    allocator, plain = manager.allocator, manager.swap_space
    tiers = TierManager(TierConfig(host_bytes=1 << 20),
                        port=PlannedTierPort.of(device.kv, None))
    manager = KVCacheManager(device, allocator, TieredSwapSpace(tiers, plain, allocator),
                             manager.retention, page_size=P, watermark=0.0,
                             scrub_freed_pages=True, stats={}, tiers=tiers)
    manager.lookup("a", [1, 2, 3, 4, 5], b"")
    assert manager.allocate("a", 0, 5)
    old = manager.seq_slot("a")
    before = _windows(device)
    manager.defer_ops()
    manager.swap_out("a", 5)
    plan = manager.take_plan()
    kinds = [op.kind for op in plan]
    assert KVOpKind.SPILL in kinds and kinds.index(KVOpKind.SWAP_OUT) < kinds.index(
        KVOpKind.SCRUB)
    (out,) = [op for op in plan if op.kind is KVOpKind.SWAP_OUT]
    assert out.seq_slots == (old,) and not out.pages and not out.src
    device.apply_ops([op for op in plan if op.kind not in (KVOpKind.SPILL,)])
    assert all(not x[:, old].any() for x in _windows(device))
    manager.lookup("y", [7], b"")  # takes a's old slot
    assert manager.returning.register("a", [1, 2, 3, 4, 5], 5, b"") is not None
    new = manager.seq_slot("a")
    assert new != old
    manager.defer_ops()
    manager.restore_window("a")
    (back,) = manager.take_plan()
    assert back.kind is KVOpKind.SWAP_IN and back.seq_slots == (new,)
    assert back.host_slot == out.host_slot and not back.pages and not back.dst
    device.apply_ops([back])
    for x, was in zip(_windows(device), before, strict=True):
        np.testing.assert_array_equal(x[:, new], was[:, old])
