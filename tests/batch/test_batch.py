"""Offline batch jobs: orderings keep outputs, bad lines fail alone, resume is exactly-once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.batch import (
    BatchRequest,
    make_ordering,
    prefix_order,
    render_record,
    run_batch,
    shared_field_order,
)
from kvjax.engine.config import EngineConfig
from kvjax.sampling import SamplingParams
from kvjax.testing import greedy_reference, tiny_chat_model

CONFIG = EngineConfig(max_num_seqs=4, num_pages=48)


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


def write_requests(path, num: int = 12, seed: int = 0) -> list[dict]:
    """`num` id-prompt requests in three interleaved prefix groups (input order never puts
    two of a group side by side)."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(3, 120, 40).tolist() for _ in range(3)]
    lines = [{"id": f"r{i}", "prompt_ids": bases[i % 3] + rng.integers(3, 120, 5).tolist(),
              "max_tokens": 5} for i in range(num)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def read_output(path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == len(lines), "an id was written twice"
    return by_id


def assert_same_outputs(got: dict[str, dict], expected: dict[str, dict]) -> None:
    """Same ids and greedy tokens; logprobs equal up to float32 reassociation (another batch
    composition or prefix-cache chunking sums in another order)."""
    assert got.keys() == expected.keys()
    for rid, line in expected.items():
        assert got[rid]["tokens"] == line["tokens"], rid
        np.testing.assert_allclose(got[rid]["logprobs"], line["logprobs"], atol=1e-4)


def test_prefix_order_puts_shared_prefixes_together():
    prompts = [[1, 2, 3], [4, 5], [1, 2, 9], [4, 6], [1, 2, 3, 7], [8]]
    assert prefix_order(prompts) == [0, 4, 2, 1, 3, 5]


def test_shared_field_order_puts_the_most_repeated_values_first():
    records = [{"name": f"n{i}", "city": "Paris" if i < 3 else "Rome", "kind": "a"}
               for i in range(4)]
    assert shared_field_order(records) == ["kind", "city", "name"]


def test_blend_keeps_prefix_groups_and_alternates_prefill_and_decode_heavy():
    def group(first: int, prompt_len: int, max_tokens: int) -> list[BatchRequest]:
        return [BatchRequest(f"{first}-{i}", [first] * prompt_len + [i],
                             SamplingParams(max_new_tokens=max_tokens)) for i in range(2)]

    # Prefill/decode ratios: 40, 1, 20, 0.5.
    requests = [*group(1, 40, 1), *group(2, 32, 32), *group(3, 40, 2), *group(4, 32, 64)]
    ids = [r.request_id for r in make_ordering("blend").arrange(requests, encode=None)]
    assert ids == ["1-0", "1-1", "4-0", "4-1", "3-0", "3-1", "2-0", "2-1"]


@pytest.mark.parametrize("order", ["prefix", "blend"])
def test_ordering_keeps_greedy_outputs_of_input_order(model, tmp_path, order):
    lines = write_requests(tmp_path / "in.jsonl")
    base = run_batch(model, tmp_path / "in.jsonl", tmp_path / "input.jsonl",
                     engine_config=CONFIG)
    other = run_batch(model, tmp_path / "in.jsonl", tmp_path / f"{order}.jsonl", order=order,
                      engine_config=CONFIG)
    expected, got = read_output(tmp_path / "input.jsonl"), read_output(tmp_path / f"{order}.jsonl")
    assert_same_outputs(got, expected)
    assert expected["r0"]["tokens"] == greedy_reference(model, lines[0]["prompt_ids"], 5)
    assert base.num_done == other.num_done == len(lines)
    assert other.prefix_hit_tokens > 0


def test_bad_lines_fail_alone_naming_id_and_field(model, tmp_path):
    write_requests(tmp_path / "in.jsonl", num=2)
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write('{"id": "neg", "prompt_ids": [1, 2], "temperature": -1}\n')
        f.write('{"id": "big", "prompt_ids": [1, 500]}\n')
        f.write("{not json\n")
        f.write('{"id": "r0", "prompt_ids": [1]}\n')
    stats = run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=CONFIG)
    out = read_output(tmp_path / "out.jsonl")
    assert stats.num_errors == 4 and len(out["r1"]["tokens"]) == 5
    assert out["neg"]["field"] == "temperature" and "'neg'" in out["neg"]["error"]
    assert out["big"]["field"] == "prompt" and "500" in out["big"]["error"]
    assert out["line:5"]["field"] == "<json>"
    assert out["r0@line:6"]["field"] == "id" and "tokens" in out["r0"]
    # A re-run after a kill before r0 was written repeats neither report.
    kept = [line for line in (tmp_path / "out.jsonl").read_text().splitlines(keepends=True)
            if json.loads(line)["id"] != "r0"]
    (tmp_path / "out.jsonl").write_text("".join(kept))
    rerun = run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=CONFIG)
    assert rerun.num_done == 1 and read_output(tmp_path / "out.jsonl")["r0"]["tokens"]


def test_rerun_cuts_a_torn_line_and_runs_each_missing_id_once(model, tmp_path):
    write_requests(tmp_path / "in.jsonl")
    run_batch(model, tmp_path / "in.jsonl", tmp_path / "full.jsonl", engine_config=CONFIG)
    full = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    # A kill after five whole lines, in the middle of writing the sixth.
    (tmp_path / "out.jsonl").write_text("".join(full[:5]) + full[5][:17])
    stats = run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=CONFIG)
    assert (stats.num_skipped, stats.num_done) == (5, len(full) - 5)
    assert_same_outputs(read_output(tmp_path / "out.jsonl"), read_output(tmp_path / "full.jsonl"))
    again = run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=CONFIG)
    assert again.num_done == 0 and len(read_output(tmp_path / "out.jsonl")) == len(full)


def test_chat_and_record_prompts_are_templated(model, tmp_path):
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}) + "\n"
        + json.dumps({"id": "t", "instruction": "Rate:", "record": {"a": "x", "b": "y"},
                      "max_tokens": 3}) + "\n")
    run_batch(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_config=CONFIG)
    out = read_output(tmp_path / "out.jsonl")
    tok = model.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert out["c"]["tokens"] == greedy_reference(model, chat, 3, stop=(127,))
    assert out["t"]["tokens"] == greedy_reference(model, tok.encode("Rate:\na: x\nb: y\n"), 3,
                                                  stop=(127,))


def test_field_order_shares_more_prefix_and_decodes_the_rewritten_prompts(model, tmp_path):
    from kvjax.bench.batch import table_records

    lines = table_records(16, max_tokens=3)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = run_batch(model, tmp_path / "in.jsonl", tmp_path / "input.jsonl", engine_config=CONFIG)
    fields = run_batch(model, tmp_path / "in.jsonl", tmp_path / "fields.jsonl", order="fields",
                       engine_config=CONFIG)
    assert fields.prefix_hit_tokens > base.prefix_hit_tokens
    order = shared_field_order([line["record"] for line in lines])
    assert order[0] != "order_id" and order[-1] == "order_id"  # The unique field goes last.
    row = lines[0]
    prompt = model.tokenizer.encode(render_record(row["instruction"], row["record"], order))
    out = read_output(tmp_path / "fields.jsonl")[row["id"]]
    assert out["tokens"] == greedy_reference(model, prompt, 3, stop=(127,))
