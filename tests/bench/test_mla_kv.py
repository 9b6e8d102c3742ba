"""bench_mla_kv's figures: the engine spec's bytes against an independent count of the values
one token stores, and the engine's pool against the spec."""

from __future__ import annotations

from kvjax.bench import mla_kv


def test_rows_count_the_latent_and_the_expanded_heads():
    result = mla_kv.run(mla_kv.Setup(dtype="bfloat16", context=8192, budget_gib=16.0))
    rows = result["rows"]
    lite = rows["DeepSeek-V2-Lite MLA"]
    assert lite["bytes_per_token"] == 27 * (512 + 64) * 2
    assert rows["DeepSeek-V2-Lite as MHA"]["bytes_per_token"] == 27 * 16 * (192 + 128) * 2
    assert rows["Llama-3-8B (GQA)"]["bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    # 16 GiB over 8192 tokens of 31104 bytes (8192 is a whole number of pages).
    assert lite["seqs_in_budget"] == 16 * 2 ** 30 // (8192 * 27 * 576 * 2)
    check = result["engine_check"]
    assert check["engine_page_bytes"] == check["spec_page_bytes"] == 16 * 2 * 576 * 2
    assert check["num_pages"] == 100
    assert check["pool_nbytes"] == check["spec_pool_bytes"]
