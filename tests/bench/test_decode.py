"""Tests of the decode benchmark's harness (kvjax.bench.decode) on small cases."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kvjax.bench import decode
from kvjax.bench.roofline import MachineRates

HLO = """\
HloModule jit_model_step

%fused_dot (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8] parameter(0)
  %p1 = f32[8,8] parameter(1)
  ROOT %dot.1 = f32[4,8] dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%attention_body (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  ROOT %gather.3 = f32[4] gather(%a, %a), offset_dims={}
}

%layer_body (s: f32[4,8]) -> f32[4,8] {
  %s = f32[4,8] parameter(0)
  %fusion.2 = f32[4,8] fusion(%s, %s), kind=kOutput, calls=%fused_dot
  %while.2 = f32[4] while(%s), condition=%cond, body=%attention_body
  ROOT %dynamic-update-slice.4 = f32[4,8] dynamic-update-slice(%s, %s, %s)
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %copy.5 = f32[4,8] copy(%x)
  ROOT %while.1 = f32[4,8] while(%copy.5), condition=%cond, body=%layer_body
}
"""


def test_ops_are_classified_by_kind_and_loop_depth():
    assert decode.classify_hlo_ops(HLO) == {
        "x": "outside the layer loop: other",
        "copy.5": "outside the layer loop: copy",
        "s": "layer loop: other",
        "fusion.2": "layer loop: matmul",  # a fusion is classified by the ops fused into it
        "a": "attention loop: other",
        "gather.3": "attention loop: gather",
        "dynamic-update-slice.4": "layer loop: KV write",
    }


def test_a_compiled_scan_has_its_matmul_and_cache_write_in_the_layer_loop():
    def layers(w, x, cache):
        def body(carry, wi):
            x, cache = carry
            y = x @ wi  # [4, 8]
            return (y, jax.lax.dynamic_update_slice_in_dim(cache, y[None], 0, axis=0)), None
        return jax.lax.scan(body, (x, cache), w)[0]

    text = jax.jit(layers).lower(jnp.ones((3, 8, 8)), jnp.ones((4, 8)),
                                 jnp.zeros((2, 4, 8))).compile().as_text()
    kinds = set(decode.classify_hlo_ops(text).values())
    assert {"layer loop: matmul", "layer loop: KV write"} <= kinds


def _rates(memory: float, matmul: float) -> MachineRates:
    return MachineRates(memory_bytes_per_s=memory, matmul_flops_per_s=matmul,
                        memory_probe_bytes=1 << 20, matmul_size=64)


def test_floor_uses_the_best_rates_and_the_slower_of_memory_and_compute():
    rates = decode.best_rates([_rates(1e9, 4e9), _rates(2e9, 1e9)])
    assert (rates.memory_bytes_per_s, rates.matmul_flops_per_s) == (2e9, 4e9)
    memory_bound = dict(system="kvjax-paged", batch=1, bytes_per_step=4e9, flops_per_step=4e9,
                        step_s=dict(median=4.0))
    compute_bound = dict(system="kvjax-contiguous", batch=1, bytes_per_step=2e9,
                         flops_per_step=1.2e10, step_s=dict(median=6.0))
    hf = dict(system="transformers-2t", batch=1, step_s=dict(median=1.0))
    # The same step against the slower probes of its own setting: half the bandwidth.
    memory_bound["setting_rates"] = dataclasses.asdict(_rates(1e9, 4e9))
    decode.add_floors([memory_bound, compute_bound, hf], rates)
    assert memory_bound["floor_bound"] == "memory"
    assert memory_bound["floor_s"] == pytest.approx(2.0)
    assert memory_bound["step_over_floor"] == pytest.approx(2.0)
    assert memory_bound["setting_floor_s"] == pytest.approx(4.0)
    assert memory_bound["step_over_setting_floor"] == pytest.approx(1.0)
    assert "step_over_setting_floor" not in compute_bound
    assert compute_bound["floor_bound"] == "compute"
    assert compute_bound["floor_s"] == pytest.approx(3.0)
    assert "floor_s" not in hf


def test_speedups_compare_with_the_fastest_transformers_run_and_exact_paged_kv():
    def r(system, batch, tok_s, step=None, prompt_len=64):
        out = dict(system=system, batch=batch, prompt_len=prompt_len, tokens_per_s=tok_s)
        return out if step is None else dict(out, step_s=dict(median=step))

    results = [r("kvjax-paged", 8, 80.0, 0.1), r("kvjax-contiguous", 8, 40.0, 0.2),
               r("kvjax-paged-int8", 8, 160.0, 0.05), r("transformers-1t", 8, 10.0),
               r("transformers-2t", 8, 20.0), r("kvjax-paged", 1, 1.0, 1.0),
               r("kvjax-paged", 8, 8.0, 1.0, prompt_len=2048)]
    assert decode.speedup_ratios(results, 8, 64) == dict(
        paged_over_contiguous_step=0.5, paged_speedup_over_hf=4.0,
        contiguous_speedup_over_hf=2.0, paged_int8_speedup_over_hf=8.0,
        paged_int8_speedup_over_paged=2.0, fastest_hf="transformers-2t")
    assert decode.speedup_ratios(results, 1, 64)["paged_speedup_over_hf"] is None
    assert decode.speedup_ratios(results, 8, 2048)["paged_over_contiguous_step"] is None


def test_token_agreement_stops_at_the_first_eos():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    test = [[1, 2, 9, 9], [5, 6, 0, 8]]
    assert decode.token_agreement(reference, test, eos=()) == pytest.approx((0.5 + 0.5) / 2)
    assert decode.token_agreement(reference, test, eos=(7,)) == pytest.approx((0.5 + 1.0) / 2)

