"""Tests of the vLLM peer's compute floor: the run's FLOPs against a token-by-token count on a
tiny config, and the floor columns of the comparison rows."""

import dataclasses
import json

import pytest

from kvjax.bench import peer_floor, vllm_peer
from kvjax.config import ModelConfig

# H=8, N=2 heads of D=4, K=1, F=16, 2 layers, V=32, tied embedding.
_CONFIG = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)


def _flops_by_hand(num_prompts, prefix_len, input_len, output_len):
    """Every token each request feeds through the model, counted one by one: per layer 2 FLOPs
    per weight of Q (8x8), K, V (8x4 each), O (8x8) and the MLP (3 x 8x16), Q.K and P.V over
    the position's keys (2 x 2 x N x D each), the head (8x32) for the logits it needs."""
    per_layer_weights = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    prompt = prefix_len + input_len
    total = 0
    for request in range(num_prompts):
        first = 0 if request == 0 else prefix_len  # the shared prefix is computed once
        for position in range(first, prompt + output_len - 1):
            keys = position + 1
            total += 2 * (2 * per_layer_weights + 2 * 2 * 4 * keys * 2)
            if position >= prompt - 1:  # the last prompt token and every decoded one
                total += 2 * 8 * 32
    return total


@pytest.mark.parametrize("prefix_len", [0, 12])
def test_run_flops_count_each_token_once_and_the_shared_prefix_once(prefix_len):
    got = peer_floor.run_flops(_CONFIG, num_prompts=3, prefix_len=prefix_len, input_len=5,
                               output_len=4)
    assert got == _flops_by_hand(3, prefix_len, 5, 4)


def test_shared_prefix_len_reads_the_workloads_flags():
    assert peer_floor.shared_prefix_len("shared_prefix_512") == 512
    assert peer_floor.shared_prefix_len("random") == 0
    with pytest.raises(ValueError, match="nope"):
        peer_floor.shared_prefix_len("nope")


def _side(throughput):
    return dict(output_throughput=throughput, median_ttft_ms=1.0, p99_ttft_ms=1.0,
                median_tpot_ms=1.0, p99_tpot_ms=1.0, completed=2, failed=0,
                generated_texts=["a", "b"], errors=["", ""])


def test_floor_columns_rate_each_server_and_the_target_against_the_floor_of_a_stored_run():
    peer = vllm_peer.PeerConfig(num_prompts=2, input_len=5, output_len=4)
    rows = vllm_peer.comparison({("float32", "random", "vllm"): _side(10.0),
                                 ("float32", "random", "kvjax"): _side(20.0),
                                 ("bfloat16", "random", "vllm"): dict(error="server: down"),
                                 ("bfloat16", "random", "kvjax"): _side(5.0)})
    rates = {"float32": 1e6, "bfloat16": 4e6}
    # As stored by the script and read back (--rows_from): its own workload sizes.
    result = json.loads(json.dumps(dict(config=dataclasses.asdict(peer), rows=rows)))
    peer_floor.add_result_floors(result, _CONFIG, rates)  # no bandwidth: FLOPs only
    rows = result["rows"]
    assert result["matmul_flops_per_s"] == rates
    flops = _flops_by_hand(2, 0, 5, 4)
    f32, bf16 = rows
    assert f32["floor"]["floor_s"] == pytest.approx(flops / 1e6)
    assert f32["floor"]["floor_output_throughput"] == pytest.approx(8 / (flops / 1e6))
    # 8 output tokens at 10 tok/s: 0.8 s for the run's FLOPs.
    assert f32["vllm"]["achieved_flops_per_s"] == pytest.approx(flops / 0.8)
    assert f32["kvjax"]["achieved_flops_per_s"] == pytest.approx(flops / 0.4)
    assert f32["target_over_floor"] == pytest.approx(1.2 * 10.0 * (flops / 1e6) / 8)
    assert bf16["floor"]["floor_s"] == pytest.approx(flops / 4e6)
    assert bf16["target_over_floor"] is None and "achieved_flops_per_s" in bf16["kvjax"]
    text = peer_floor.floor_table(rows)
    assert f"| float32 | random | {flops / 1e12:.2f} | 0.0 | {flops / 1e6:.1f} |" in text
    assert text.splitlines()[-1].endswith("| - | 0.0 | - |")  # bfloat16: vLLM down


_WEIGHTS = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16) + 8 * 32  # 2 layers and the tied head


@pytest.mark.parametrize("bytes_per_s, bound", [(1e12, "flops"), (1e3, "bytes")])
def test_weight_reads_floor_counts_one_read_per_step_of_the_fewest_steps(bytes_per_s, bound):
    # 5 requests of 4 output tokens, at most 2 per step (concurrency 2 < 3 sequences): each
    # request's 4 tokens need 4 passes, so 20 request-passes take >= ceil(20 / 2) = 10 steps.
    peer = vllm_peer.PeerConfig(num_prompts=5, input_len=3, output_len=4, max_concurrency=2,
                                max_num_seqs=3)
    assert peer_floor.min_steps(peer) == 10
    (row,) = peer_floor.floor_rows(_CONFIG, peer, {"bfloat16": 1e6}, ("random",),
                                   bytes_per_s=bytes_per_s)
    floor = row["floor"]
    flops_s = _flops_by_hand(5, 0, 3, 4) / 1e6
    assert floor["weight_bytes_per_step"] == 2 * _WEIGHTS  # two bytes a weight
    assert floor["bytes_floor_s"] == pytest.approx(10 * 2 * _WEIGHTS / bytes_per_s)
    assert floor["flops_floor_s"] == pytest.approx(flops_s)
    assert floor["bound"] == bound
    assert floor["floor_s"] == pytest.approx(max(flops_s, floor["bytes_floor_s"]))
    assert floor["floor_output_throughput"] == pytest.approx(20 / floor["floor_s"])
    assert f"| {floor['min_steps']} | {floor['bytes_floor_s']:.1f} |" in peer_floor.floor_table(
        [row])
