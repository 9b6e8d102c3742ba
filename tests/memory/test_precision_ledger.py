"""In-place demotion as data: the precision ledger's byte accounting, and the DEMOTE op applied
by the model runner in its dispatch, re-encoding a running sequence's pages with no recompile.

Oracles: the spec's bytes per class, computed by hand; for the op, the ledger's classes, the
rows it must not touch and the rounding it must do (the state's `demote` itself is checked
against numpy in tests/kv/test_mixed_state.py).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig
from kvjax.engine.runner import ModelRunner
from kvjax.engine.step import StepPrograms
from kvjax.kv import mixed
from kvjax.memory.block_manager import AllocStatus, BlockManager
from kvjax.memory.ops import DATA_KINDS, HostKV, KVOpKind
from kvjax.memory.precision import (
    LedgerPages,
    MixedOptions,
    PrecisionLedger,
    RoundedPages,
    num_page_slots,
)

CONFIG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, name="ledger-test")
P = 4


def _ledger(exact_pages: int) -> PrecisionLedger:
    spec = mixed.cache_spec(CONFIG, P)
    budget = exact_pages * spec.page_bytes_at(0, 0)
    return PrecisionLedger(spec, num_page_slots(spec, budget), budget)


def test_demotion_frees_the_class_difference_for_new_pages():
    ledger = _ledger(exact_pages=4)
    spec = ledger.spec
    exact, k8v4 = spec.page_bytes_at(0, 0), spec.page_bytes_at(8, 4)
    assert len(ledger.k_bits) == int(4 * exact // spec.page_bytes_at(4, 4)) > 4
    ledger.hold([0, 1, 2, 3])
    assert not ledger.can_hold(1)
    with pytest.raises(ValueError, match=r"pages \[4\]"):
        ledger.hold([4])
    op = ledger.demote([0, 1, 2], 8, 4)
    assert op.kind is KVOpKind.DEMOTE and op.kind in DATA_KINDS
    assert op.pages == (0, 1, 2) and op.dst == (0, 1, 2, 2) and (op.bits, op.v_bits) == (8, 4)
    assert ledger.bytes_freed == pytest.approx(3 * (exact - k8v4))
    assert ledger.bytes_held == pytest.approx(exact + 3 * k8v4)
    assert ledger.can_hold(1) == (3 * (exact - k8v4) >= exact)
    # A finer class changes nothing; keys may go coarser while values stay.
    assert ledger.demote([0], 0, 0) is None
    assert ledger.demote([0], 4, 0).dst == (0,)
    assert (ledger.k_bits[0], ledger.v_bits[0]) == (4, 4)
    with pytest.raises(ValueError, match="page 9 is not held"):
        ledger.demote([9], 8, 8)
    ledger.release([0, 1, 2, 3])
    assert ledger.bytes_held == pytest.approx(0.0)
    assert (ledger.k_bits[:4] == 0).all()


def test_cold_pages_are_full_unshared_and_oldest_first():
    ledger = _ledger(exact_pages=8)
    ledger.hold([7, 3, 5, 6])
    table = [7, 3, 5, 6]
    assert ledger.cold_pages(table, 3 * P + 1, 8, 8) == [7, 3, 5]  # the partial page stays
    assert ledger.cold_pages(table, 3 * P + 1, 8, 8, shared=[7]) == [3, 5]
    ledger.demote([3], 8, 8)
    assert ledger.cold_pages(table, 3 * P, 8, 8) == [7, 5]
    assert ledger.cold_pages(table, 3 * P, 4, 8) == [7, 3, 5]


def test_runner_applies_demote_ops_from_data_without_recompiling():
    rng = np.random.default_rng(0)
    kv = mixed.init_mixed_kv(CONFIG, 8, P)
    shape = (2 * P, CONFIG.num_kv_heads, CONFIG.head_dim)
    write = jax.jit(lambda kv, layer, k, v: kv.write(layer, jnp.arange(8, 16), k, v))
    for layer in range(CONFIG.num_layers):
        kv = write(kv, jnp.int32(layer), jnp.asarray(rng.normal(size=shape), jnp.float32),
                   jnp.asarray(rng.normal(size=shape), jnp.float32))
    programs = StepPrograms(CONFIG)
    runner = ModelRunner(programs, types.SimpleNamespace(feed_rows=1),
                         jax.tree.map(jnp.copy, kv), {}, "v0", page_size=P)  # donated
    ledger = _ledger(exact_pages=8)
    ledger.hold([2, 3])
    ops = [ledger.demote([2], 8, 8), ledger.demote([2, 3], 4, 8), ledger.demote([3], 8, 4)]
    runner.apply_ops(ops)
    assert programs.num_compiles == 2  # one program per padded page count, whatever the class
    # The generic host-side program (`HostKV`, jitted here) applies the same ops alike.
    host = jax.jit(lambda kv: functools.reduce(HostKV(None).run_op, ops, kv))(kv)
    np.testing.assert_array_equal(host.k_bits, runner.kv.k_bits)
    np.testing.assert_array_equal(host.v_bits, runner.kv.v_bits)
    bits = np.asarray(runner.kv.k_bits), np.asarray(runner.kv.v_bits)
    assert (bits[0][:, 2] == 4).all() and (bits[1][:, 2] == 8).all()
    assert (bits[0][:, 3] == 4).all() and (bits[1][:, 3] == 4).all()
    assert (ledger.k_bits[[2, 3]] == 4).all() and list(ledger.v_bits[[2, 3]]) == [8, 4]
    # Other pages keep their bytes; demoted ones read back rounded, not exact.
    for got, want in zip(runner.kv.page_leaves(), kv.page_leaves(), strict=True):
        np.testing.assert_array_equal(np.asarray(got)[:, [0, 1, 4, 5, 6, 7]],
                                      np.asarray(want)[:, [0, 1, 4, 5, 6, 7]])
    load = jax.jit(lambda kv: kv.load_pages(jnp.int32(0), jnp.asarray([[2]])))
    err = np.abs(np.asarray(load(runner.kv)[0]) - np.asarray(load(kv)[0]))
    assert 0 < err.max() < 0.5


@jax.jit
def _write_page(kv, page, k, v):
    """Every layer's rows of `page` written (at the pool's write class)."""
    slots = page * P + jnp.arange(P, dtype=jnp.int32)
    for layer in range(CONFIG.num_layers):
        kv = kv.write(jnp.int32(layer), slots, k[layer], v[layer])
    return kv


_demote_pages = jax.jit(lambda kv, pages, k_bits, v_bits: kv.demote(pages, k_bits, v_bits))


def _bytes_by_rows(ledger: PrecisionLedger, kv, held) -> float:
    """Brute force: the bytes of every held page's rows, each row (of each layer) at the
    classes the device holds for it."""
    k_bits, v_bits = np.asarray(kv.k_bits), np.asarray(kv.v_bits)  # [L, N, P]
    rows = CONFIG.num_layers * P
    return sum(ledger.spec.page_bytes_at(int(kb), int(vb)) / rows
               for page in held for kb, vb in zip(k_bits[:, page].reshape(-1),
                                                  v_bits[:, page].reshape(-1), strict=True))


@pytest.mark.parametrize("seed", range(3))
def test_ledger_bytes_equal_a_count_over_the_rows_classes(seed):
    """Pages allocated and written, demoted by importance (`importance_bits`: whole pages,
    one op per class, as a policy would) and freed, in random order: after every event the
    ledger's bytes equal a brute-force sum over the held pages' rows of their device classes'
    bytes, and each held page's rows carry the ledger's class for it."""
    rng = np.random.default_rng(seed)
    ledger = _ledger(exact_pages=5)
    num = len(ledger.k_bits)
    classes = MixedOptions(coarsest_k_bits=int(rng.choice([8, 4]))).classes()
    kv = mixed.init_mixed_kv(CONFIG, num, P)
    shape = (CONFIG.num_layers, P, CONFIG.num_kv_heads, CONFIG.head_dim)
    held: list[int] = []
    for _ in range(16):
        event = rng.random()
        if ledger.can_hold(1) and (event < 0.45 or not held):
            page = int(rng.choice(sorted(set(range(num)) - set(held))))
            ledger.hold([page])
            held.append(page)
            kv = _write_page(kv, page, *(jnp.asarray(rng.normal(size=shape), jnp.float32)
                                         for _ in "kv"))
        elif event < 0.8:
            pages = np.asarray(rng.permutation(held)[:rng.integers(1, len(held) + 1)])
            scores = jnp.asarray(rng.normal(size=len(pages) * P), jnp.float32)
            page_bits = np.asarray(mixed.importance_bits(scores, P, 1, 1))
            for bits in (8, 4):
                k_bits, v_bits = classes[bits]
                op = ledger.demote(pages[page_bits == bits], k_bits, v_bits, pad_to=num)
                if op is not None:
                    kv = _demote_pages(kv, np.asarray(op.dst, np.int32), np.int32(k_bits),
                                       np.int32(v_bits))
        else:
            page = held.pop(int(rng.integers(len(held))))
            ledger.release([page])
        assert ledger.bytes_held == pytest.approx(_bytes_by_rows(ledger, kv, held))
        for page in held:
            assert (np.asarray(kv.k_bits[:, page]) == ledger.k_bits[page]).all()
            assert (np.asarray(kv.v_bits[:, page]) == ledger.v_bits[page]).all()
    assert _demote_pages._cache_size() == 1  # one padded width, any class


def test_block_manager_over_the_ledger_admits_by_bytes_and_demotion_makes_room():
    """A block manager drawing pages through `LedgerPages` reports free what the byte budget
    has room for; demoting one sequence's cold pages lets another allocate, and freeing every
    sequence returns every byte."""
    ledger = _ledger(exact_pages=6)
    blocks = BlockManager(len(ledger.k_bits), P, enable_prefix_cache=False,
                          pages=LedgerPages(ledger))
    assert blocks.capacity == 6 and blocks.num_free_pages() == 6
    blocks.add_sequence("a", list(range(4 * P)))
    assert blocks.ensure_writable("a", 0, 4 * P)[0] is AllocStatus.OK
    blocks.add_sequence("b", list(range(3 * P)))
    assert blocks.ensure_writable("b", 0, 3 * P)[0] is AllocStatus.NO_PAGES
    assert blocks.num_free_pages() == 2
    table = blocks.block_table("a")
    ledger.demote(ledger.cold_pages(table, 4 * P, 4, 4)[:3], 4, 4)  # the newest page stays
    exact, int4 = ledger.spec.page_bytes_at(0, 0), ledger.spec.page_bytes_at(4, 4)
    assert blocks.num_free_pages() == int((2 * exact + 3 * (exact - int4)) // exact) >= 3
    assert blocks.ensure_writable("b", 0, 3 * P)[0] is AllocStatus.OK
    for seq_id in ("a", "b"):
        blocks.free(seq_id)
    assert ledger.bytes_held == pytest.approx(0.0) and blocks.num_free_pages() == 6


def test_demoted_pages_leave_the_prefix_index_and_their_sequence_feeds_it_no_more():
    """A prefix hit's pages, demoted with their sequence's other full pages, leave the index
    (and a page demoted before its sequence commits it never enters it), so a later prompt
    hits none of them; released, they go to the free list with their bytes. Brute force:
    no indexed page is at a class but the write class."""
    ledger = _ledger(exact_pages=12)
    blocks = BlockManager(len(ledger.k_bits), P, enable_prefix_cache=True,
                          pages=LedgerPages(ledger))
    rounded = RoundedPages(blocks)
    prompt = list(range(3 * P + 1))

    def serve(seq_id, tokens, committed):
        hit = blocks.add_sequence(seq_id, tokens)
        assert blocks.ensure_writable(seq_id, hit, len(tokens))[0] is AllocStatus.OK
        blocks.commit(seq_id, tokens[:committed])
        return hit

    def check_index():
        indexed = [p for p in range(len(ledger.k_bits)) if blocks.prefix_cache.is_indexed(p)]
        assert all((ledger.k_bits[p], ledger.v_bits[p]) == (0, 0) for p in indexed)
        return indexed

    assert serve("a", prompt, len(prompt)) == 0
    blocks.free("a")
    assert serve("b", prompt + [7] * P, 3 * P + 2) == 3 * P  # hits a's three pages
    table = blocks.block_table("b")
    assert not blocks.prefix_cache.is_indexed(table[3])  # full, not committed yet
    cold = ledger.cold_pages(table, 4 * P, 4, 4)
    assert cold == table[:4] and ledger.demote(cold, 4, 4) is not None
    rounded.round_pages("b", cold)
    blocks.commit("b", prompt + [7] * P)
    assert check_index() == [] and not rounded.indexable("b")
    assert serve("c", prompt, len(prompt)) == 0  # recomputes: no hit on a rounded page
    assert len(check_index()) == 3 and not set(check_index()) & set(cold)
    for seq_id in ("b", "c"):
        blocks.free(seq_id)
    rounded.discard("b")
    assert blocks.num_used_pages() == 0 and rounded.indexable("b")
    assert ledger.bytes_held == pytest.approx(3 * ledger.write_page_bytes)  # c's cached pages


def test_mixed_options_map_a_controllers_precision_to_the_pools_classes():
    """K8V4 keeps keys at 8 bits when a controller asks for 4; a pool written at int8 never
    takes a finer class; a bad option fails naming it."""
    assert MixedOptions().classes() == {0: (0, 0), 8: (8, 8), 4: (4, 4)}
    assert MixedOptions(coarsest_k_bits=8).classes() == {0: (0, 0), 8: (8, 8), 4: (8, 4)}
    assert MixedOptions(write_bits=(8, 8)).classes() == {0: (8, 8), 8: (8, 8), 4: (4, 4)}
    with pytest.raises(ValueError, match="coarsest_v_bits"):
        MixedOptions(coarsest_v_bits=2)
    with pytest.raises(ValueError, match="colour"):
        MixedOptions.parse({"colour": 1})
