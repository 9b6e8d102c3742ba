"""bench_kv_bytes's figures: the engine spec's bytes per model against an independent count from
the published attention shapes, and engines built on each model's KV shape against the spec."""

from __future__ import annotations

import pytest

from kvjax.bench import kv_bytes

BF16 = 2
CONTEXT = 8192
BUDGET = 16 * 2**30


def test_rows_count_each_models_layer_groups():
    rows = kv_bytes.table(kv_bytes.Setup(dtype="bfloat16", context=CONTEXT, budget_gib=16))
    kv = lambda layers, heads, dim: layers * 2 * heads * dim * BF16  # noqa: E731
    # Global layers hold every token, window layers their window.
    expected = {
        "Llama-3.2-1B": (kv(16, 8, 64), kv(16, 8, 64)),
        "Qwen3-0.6B": (kv(28, 8, 128), kv(28, 8, 128)),
        "Gemma-3-1B": ((kv(4, 1, 256) * CONTEXT + kv(22, 1, 256) * 512) / CONTEXT,
                       kv(26, 1, 256)),
        "Mistral-7B": (kv(32, 8, 128) * 4096 / CONTEXT, kv(32, 8, 128)),
        "Phi-3-mini": (kv(32, 32, 96) * 2047 / CONTEXT, kv(32, 32, 96)),
        "DeepSeek-V2-Lite": (27 * (512 + 64) * BF16, 27 * 16 * (192 + 128) * BF16),
        "DeepSeek-V2": (60 * 576 * BF16, 60 * 128 * (192 + 128) * BF16),
        "DeepSeek-V3": (61 * 576 * BF16, 61 * 128 * (192 + 128) * BF16),
    }
    assert {name: (r["kvjax_bytes_per_token"], r["full_bytes_per_token"])
            for name, r in rows.items()} == expected
    # Gemma: a page holds gcd(4, 22) = 2 layers of 16 tokens; an 8k sequence holds 512 pages
    # in each of the 2 global tables and 32 (its window) in each of the 11 window tables.
    gemma = rows["Gemma-3-1B"]
    assert gemma["kvjax_seqs_in_budget"] == BUDGET // (2 * 16 * 1024) // (2 * 512 + 11 * 32)
    assert gemma["full_seqs_in_budget"] == BUDGET // (26 * 16 * 1024) // 512
    # Phi-3's window of 2047 tokens spans 128 pages at the end of an 8k sequence.
    assert rows["Phi-3-mini"]["kvjax_seqs_in_budget"] == BUDGET // (32 * 16 * kv(1, 32, 96)) // 128
    assert rows["Mistral-7B"]["kvjax_seqs_in_budget"] == 2 * rows["Mistral-7B"][
        "full_seqs_in_budget"] == 32


@pytest.mark.parametrize("model", kv_bytes.Setup().check_models)
def test_engine_on_the_kv_shape_honours_the_budget_and_holds_the_spec_pages(model):
    """Two requests crossing every window (divided by 128), in a budget sized for both: the pool
    takes the spec's page bytes within the budget, both decode together without preemption, and
    each decoding sequence holds the spec's pages; a windowed model's budget holds fewer than two
    of its sequences with every layer global."""
    setup = kv_bytes.Setup(check_sequences=2, check_context=96, check_new_tokens=4,
                           window_scale=128)  # windows of 4 (Gemma), 32 (Mistral), 15 (Phi-3)
    check = kv_bytes.engine_check(kv_bytes.model_configs()[model], setup)
    assert check["engine_page_bytes"] == check["spec_page_bytes"]
    assert check["num_pages"] == check["budget_bytes"] // check["spec_page_bytes"]
    assert check["pool_nbytes"] == check["spec_pool_bytes"] <= check["budget_bytes"]
    assert check["most_running"] == 2 and check["preemptions"] == 0
    assert check["completed_tokens"] == {"r0": 4, "r1": 4}
    assert check["decode_checks"] > 0 and check["held_mismatches"] == []
    # At token granularity (`KVCacheSpec.bytes_held`) a table's pages cover up to P - 1 tokens
    # past its last one, and a window's up to P - 1 before its first.
    low, high = check["held_minus_spec_bytes"]
    assert 0 <= low <= high < 2 * check["num_table_groups"] * check["spec_page_bytes"]
    assert check["free_pages_after"] == check["num_pages"]
    if check["windows"]:  # the windows are what lets both sequences in
        assert check["all_global_seqs_in_pool"] < 2
