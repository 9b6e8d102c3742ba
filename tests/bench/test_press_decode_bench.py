"""The per-press decode benchmark (kvjax.bench.press_decode) on the tiny model: the pages each
sequence held at every timed decode dispatch, read from the allocator, against the budget's
arithmetic written out here, and the KV-bytes ratio against pages x bytes of a page computed
from the model's shape."""

import numpy as np
import pytest

from kvjax.bench import press_decode
from kvjax.testing import tiny_model

P, BUDGET, CONTEXT = 4, 12, 24


@pytest.mark.parametrize("variant,per_head", [(f"snapkv:{BUDGET}:window=4", False),
                                              (f"knorm:{BUDGET}:schedule=per_head", True)])
def test_pages_held_and_bytes_read_follow_the_budget(variant, per_head):
    model = tiny_model()
    mc = model.config
    settings = press_decode.PressDecodeBench(variants=(variant,), batch=2, context=CONTEXT,
                                             new_tokens=4, page_size=P, chunk=32)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 120, CONTEXT)] for _ in range(2)]
    report = press_decode.run(model, settings, prompts)
    rows = report["rows"]
    exact_page = P * mc.kv_bytes_per_token("float32")  # every layer and kv head, K and V
    tables = {"none": 1, variant: mc.num_layers * mc.num_kv_heads if per_head else 1}

    def pages(variant, computed, prompt):
        if variant == "none":
            return -(-computed // P)
        return tables[variant] * -(-(BUDGET + computed - prompt) // P)

    step_bytes = {}
    for variant, row in rows.items():
        assert row["samples"] and row["step_s"]["n"] >= 1, variant
        for step in row["samples"]:
            assert [held for held, _, _ in step] == [pages(variant, c, p) for _, c, p in step]
            assert all(p == CONTEXT and c > p for _, c, p in step)
        page = exact_page / tables[variant]
        step_bytes[variant] = np.mean([sum(h for h, _, _ in step) * page
                                       for step in row["samples"]])
        assert row["kv_bytes_per_step"] == pytest.approx(step_bytes[variant])
        assert row["pages_held_per_seq"] == pytest.approx(row["pages_expected_per_seq"])
    for variant, row in rows.items():
        assert row["kv_bytes_ratio"] == pytest.approx(step_bytes[variant] / step_bytes["none"])
        assert row["kv_bytes_ratio"] < 1.0 or variant == "none"
    assert f"| {variant} |" in press_decode.format_table(report)


def test_quest_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="quest:256"):
        press_decode.PressDecodeBench(variants=("quest:256",))


def test_expected_pages_follow_each_scheme():
    # 24 prompt tokens, 3 generated (27 computed), budget 12, pages of 4 tokens.
    assert press_decode.expected_pages("none", 24, 27, P, 1) == 7  # ceil(27 / 4)
    assert press_decode.expected_pages("snapkv:12:window=4", 24, 27, P, 1) == 4  # ceil(15/4)
    assert press_decode.expected_pages("knorm:12:schedule=per_head", 24, 27, P, 90) == 360
    # Unequal tables: the 30 tables' 15-token mean, pooled before rounding: ceil(450 / 4).
    assert press_decode.expected_pages("snapkv:12:window=4:schedule=pyramid", 24, 27, P,
                                       30) == 113
    # Evicting as it decodes: back to 12 tokens once it holds 16, so at most 4 pages.
    assert press_decode.expected_pages("streaming:12:num_sinks=2", 24, 27, P, 1) == 4
