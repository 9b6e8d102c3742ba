"""Tests of the prefill benchmark (kvjax.bench.prefill)."""

from kvjax.bench import prefill, roofline
from kvjax.bench.decode import make_prompts
from kvjax.bench.roofline import MachineRates


def test_prefill_flops_count_every_token_through_the_layers_and_the_head_once(embedded_model):
    c = embedded_model.config
    head = c.hidden_size * c.vocab_size
    one = prefill.prefill_flops(c, 1)
    # One token: every matmul weight once, and a single attention score and value.
    assert one == 2 * roofline.matmul_params(c) + 4 * c.num_heads * c.head_dim * c.num_layers
    # Each further token adds the layers' weights, not the head, plus its causal attention.
    two = prefill.prefill_flops(c, 2)
    layers = roofline.matmul_params(c) - head
    assert two - one == 2 * layers + 2 * c.num_heads * c.head_dim * (6 - 2) * c.num_layers


def test_chunked_prefill_first_token_matches_transformers(embedded_model, hf_embedded):
    prompt = make_prompts(embedded_model, 1, 40, seed=0)[0]
    rates = MachineRates(memory_bytes_per_s=1e10, matmul_flops_per_s=1e11,
                         memory_probe_bytes=0, matmul_size=0)
    results = prefill.bench_prefill(embedded_model, hf_embedded, prompt, chunks=[16, 64],
                                    threads=1, repeats=1, rates=rates)
    kvjax_rows = [r for r in results if "chunk" in r]
    assert [r["chunk"] for r in kvjax_rows] == [16, 64]
    assert all(r["first_token_matches_hf"] for r in kvjax_rows)
    for r in results:
        assert r["tokens_per_s"] == 40 / r["prefill_s"]["median"]
        assert r["floor_s"] == prefill.prefill_flops(embedded_model.config, 40) / 1e11
    assert set(prefill.speedups(results)) == {"ctx=40,chunk=16", "ctx=40,chunk=64"}
