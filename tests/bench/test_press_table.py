"""Tests of the press quality table: the probe writer, the merger, and the peer's KL.

Pure Python on tiny inputs: kvpress, torch and a model are not needed (the peer script imports
them only where a model runs).
"""

import importlib.util
import pathlib

import numpy as np
import pytest

from kvjax.bench import press_table, retention
from kvjax.bench.metrics import quality_stats

_PEER = pathlib.Path(__file__).parents[2] / "scripts" / "kvpress_peer.py"


def _peer_module():
    spec = importlib.util.spec_from_file_location("kvpress_peer", _PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(kl_mean, retrieval=1.0):
    return dict(kl_mean=kl_mean, kl_p99=2 * kl_mean, kl_max=3 * kl_mean, top1_agreement=0.5,
                retrieval_pass=retrieval)


def test_needle_position_finds_the_answer_tokens_in_the_prompt():
    assert retention.needle_position([1, 5, 7, 8, 9, 7, 8], [7, 8]) == 2
    assert retention.needle_position([1, 5, 7, 9], [7, 8]) is None


def test_probes_payload_carries_what_a_peer_replays():
    probes = [([1, 2, 3, 4], [3]), ([1, 9, 8, 7, 6], [8, 7])]
    runs = [dict(tokens=[3, 11, 12]), dict(tokens=[8, 7, 13])]
    settings = retention.RetentionBench(variants=(), depths=(0.1, 0.9), seed=5)
    payload = retention.probes_payload(probes, runs, settings)
    assert payload == [
        dict(prompt=[1, 2, 3, 4], answer=[3], needle_position=2, depth=0.1, seed=5,
             continuation=[3, 11, 12]),
        dict(prompt=[1, 9, 8, 7, 6], answer=[8, 7], needle_position=2, depth=0.9, seed=6,
             continuation=[8, 7, 13])]


def test_merge_puts_each_peer_row_under_its_kvjax_row_with_the_kl_ratio():
    kvjax = dict(prompt_tokens=[10, 12], rows={
        "none": _row(0.0), "snapkv:4": _row(0.6, 0.5), "quest:4": _row(0.2),
        "knorm:4": _row(0.9, 0.0)})
    kvpress = dict(prompt_tokens=[10, 12], rows={
        "none": _row(0.0), "snapkv:4": _row(0.3), "knorm:4": _row(0.0, 0.0)})
    table = press_table.merge(kvjax, kvpress)
    assert [(r["variant"], r["framework"]) for r in table["rows"]] == [
        ("snapkv:4", "kvjax"), ("snapkv:4", "kvpress"), ("quest:4", "kvjax"),
        ("knorm:4", "kvjax"), ("knorm:4", "kvpress")]
    assert table["kl_ratio"] == {"snapkv:4": pytest.approx(2.0)}  # no ratio to a zero KL
    markdown = press_table.format_table(table).splitlines()
    assert len(markdown) == 2 + 5
    assert markdown[2].startswith("| snapkv:4 | kvjax | 0.600 |")
    assert markdown[2].endswith("| 1 / 2 | 2.00 |")
    assert "snapkv:4 (SnapKVPress) | kvpress" in markdown[3]


def test_merge_refuses_reports_on_different_probes():
    with pytest.raises(ValueError, match=r"\[10, 12\] \(kvjax\) vs \[10, 13\]"):
        press_table.merge(dict(prompt_tokens=[10, 12], rows={}),
                          dict(prompt_tokens=[10, 13], rows={}))
    with pytest.raises(ValueError, match=r"\[10, 12\] vs \[11, 12\]"):
        press_table.combine([dict(prompt_tokens=[10, 12], rows={}),
                             dict(prompt_tokens=[11, 12], rows={})])


def test_combine_joins_runs_on_the_same_probes_first_row_wins():
    runs = [dict(prompt_tokens=[10], rows={"none": _row(0.0), "tova:4": _row(0.1)}),
            dict(prompt_tokens=[10], rows={"none": _row(0.5), "knorm:4": _row(0.2)})]
    combined = press_table.combine(runs)
    assert list(combined["rows"]) == ["none", "tova:4", "knorm:4"]
    assert combined["rows"]["none"]["kl_mean"] == 0.0


def test_peer_kl_is_computed_as_kvjax_computes_it():
    peer = _peer_module()
    rng = np.random.default_rng(0)
    ref, test = rng.normal(size=(2, 7, 50)) * 3  # [T, V] logits
    kl = peer.token_kl(ref, test)
    stats = quality_stats(ref, test)
    own = peer.quality(kl, ref.argmax(-1) == test.argmax(-1), [True])
    for key in ("kl_mean", "kl_p99", "kl_max", "top1_agreement"):
        assert own[key] == pytest.approx(stats[key], rel=1e-12)
    # The same distribution twice: no divergence.
    assert np.allclose(peer.token_kl(ref, ref + 5.0), 0.0)


def test_peer_resumed_run_reports_what_one_run_over_every_probe_reports():
    peer = _peer_module()
    rng = np.random.default_rng(1)
    stats = dict(kl=[rng.exponential(size=24) for _ in range(5)],
                 top1=[rng.random(24) < 0.8 for _ in range(5)],
                 passed=[bool(b) for b in rng.random(5) < 0.5],
                 agree=list(rng.random(5)))

    def report(probes):
        part = {key: [value[i] for i in probes] for key, value in stats.items()}
        return dict(rows={"snapkv:8": peer.row_of(part, "SnapKVPress")},
                    prompt_tokens=[100 + i for i in probes])

    merged = peer.merge_reports(report([0, 1, 2]), report([3, 4]))
    whole = report(range(5))
    assert merged["prompt_tokens"] == whole["prompt_tokens"]
    assert merged["rows"]["snapkv:8"].keys() == whole["rows"]["snapkv:8"].keys()
    for key, value in whole["rows"]["snapkv:8"].items():
        expected = value if isinstance(value, str | list) else pytest.approx(value, rel=1e-12)
        assert merged["rows"]["snapkv:8"][key] == expected, key
    with pytest.raises(ValueError, match="rows differ"):
        peer.merge_reports(report([0]), dict(rows={}, prompt_tokens=[]))


def test_peer_budget_keeps_exactly_the_budget_and_variants_need_a_peer():
    peer = _peer_module()
    for budget, length in ((512, 2043), (1024, 2043), (2048, 8190), (3, 7)):
        ratio = peer.compression_ratio(budget, length)
        assert int(length * (1 - ratio)) == budget  # kvpress's count of kept tokens
    with pytest.raises(ValueError, match="budget 9"):
        peer.compression_ratio(9, 9)
    assert peer.parse_variant("snapkv:512:window=32") == ("snapkv", 512, {"window": 32})
    assert set(peer.PEERS) == set(press_table.KVPRESS_PEERS)


def test_peer_refuses_a_schedule_kvpress_lacks_before_importing_kvpress():
    peer = _peer_module()
    with pytest.raises(ValueError, match="no 'pyramid' schedule over 'knorm'"):
        peer.make_press("knorm:512:schedule=pyramid")
    with pytest.raises(ValueError, match="no 'adakv' schedule over 'streaming'"):
        peer.make_press("streaming:512:schedule=adakv")
    with pytest.raises(ValueError, match="no 'per_head' schedule over 'streaming'"):
        peer.make_press("streaming:512:schedule=per_head")
    with pytest.raises(ValueError, match="has only pooling=avg"):
        peer.make_press("snapkv:512:schedule=per_head:pooling=max")
    with pytest.raises(ValueError, match=r"options \['head_floor'\]"):
        peer.make_press("snapkv:512:schedule=pyramid:head_floor=0.5")
    with pytest.raises(ValueError, match="no 'global' schedule over 'snapkv'"):
        peer.make_press("snapkv:512:schedule=global")
    with pytest.raises(ValueError, match="head_floor=0 only"):
        peer.make_press("kvzip:512:schedule=global:head_floor=2")
