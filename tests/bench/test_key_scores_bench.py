"""bench_key_scores: every query tile scores what the untiled pass scores."""

from kvjax.bench import key_scores


def test_each_tile_row_scores_what_the_untiled_pass_scores():
    result = key_scores.run(key_scores.Setup(repeats=1), [(96, 48)], [16, 64])
    rows = list(result["rows"].values())
    assert [r["query_tile"] for r in rows] == [48, 16]  # untiled first; a tile >= C is untiled
    assert rows[0]["vs_untiled"] == 1.0 and rows[1]["ms"] > 0
    assert all(r["max_rel_diff"] < 1e-5 for r in rows)
    assert "load_average_end" in result["env"]
