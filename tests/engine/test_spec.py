"""Speculative decoding is lossless: greedy tokens equal plain decoding's, sampled ones follow
the model's distribution, and rejected drafts leave nothing behind.

Oracles: the cache-free dense greedy reference (`kvjax.testing.greedy_reference`) for greedy
outputs; for sampling, the exact distribution of the second generated token (the first one a
verify step emits), computed from the dense forward pass over every first token, against which
the empirical distribution over many seeds must lie within a total-variation bound that a
verifier accepting drafts too often (or never resampling) exceeds by far.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.kv.state import pages_for
from kvjax.scheduler.spec import NoDrafts, SpecConfig, register_drafter
from kvjax.testing import dense_logprobs, greedy_reference, tiny_model

NEW = 12
P = 4
BASE = dict(page_size=P, max_num_batched_tokens=48, max_prefill_chunk=16, max_num_seqs=4,
            debug_provenance=True)
NGRAM = SpecConfig("ngram", num_draft_tokens=3)
SPARSE = SpecConfig("sparse_self", num_draft_tokens=3, options=dict(num_sinks=P, window=2 * P))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def workload(model):
    """Prompts with repeats (prompt lookup finds matches), two sharing a prefix."""
    rng = np.random.default_rng(5)
    motif = [int(t) for t in rng.integers(2, 120, size=6)]
    shared = motif * 2
    prompts = [shared + [int(t) for t in rng.integers(2, 120, size=n)] + motif[:3]
               for n in (3, 7, 2, 9, 5)]
    prompts[1] = [int(t) for t in rng.integers(2, 120, size=10)]  # no prefix shared
    return prompts, [greedy_reference(model, p, NEW) for p in prompts]


class WrongDrafts(NoDrafts):
    """Proposes tokens the model rarely picks: most drafts are rejected."""

    name = "wrong"

    def propose(self, tokens, num):
        return [(tokens[-1] + 1 + i) % 120 + 2 for i in range(num)]


register_drafter("wrong", WrongDrafts)


def generate(model, prompts, spec, **overrides):
    engine = Engine(model, EngineConfig(**{**BASE, **overrides}, spec=spec))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [NGRAM, SPARSE], ids=["ngram", "sparse_self"])
@pytest.mark.parametrize("name,overrides", [
    ("plenty", dict(num_pages=128)),
    ("recompute", dict(num_pages=16)),
    pytest.param("swap", dict(num_pages=16, preemption_mode=PreemptionMode.SWAP),
                 marks=pytest.mark.slow),
    pytest.param("int8", dict(num_pages=128, kv_codec="int8"), marks=pytest.mark.slow),
])
def test_greedy_equals_plain_decoding(model, workload, spec, name, overrides):
    prompts, refs = workload
    engine, got = generate(model, prompts, spec, **overrides)
    if name == "int8":  # The oracle is the same engine without speculation.
        _, refs = generate(model, prompts, SpecConfig(), **overrides)
    assert got == refs
    stats = engine.stats
    assert stats["spec_proposed"] > 0 and stats["spec_verify_rows"] > 0
    assert 0 < stats["spec_accepted"] <= stats["spec_proposed"]
    if spec.method == "sparse_self":
        assert stats["spec_draft_steps"] > 0
    if name in ("recompute", "swap"):
        assert stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert stats["stale_kv_reads"] == 0
    assert engine.allocator.num_used_pages() == 0


def test_rejected_drafts_leave_no_trace(model, workload):
    """After every step each running sequence holds exactly the pages its verified tokens
    need, and the prefix cache serves a later request with the verified tokens' KV only."""
    prompts, refs = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=128,
                                        spec=SpecConfig("wrong", num_draft_tokens=3)))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
        for seq in engine.scheduler.running:
            held = len(engine.allocator.block_table(seq.seq_id))
            assert held == pages_for(seq.num_computed, P), seq.seq_id
            if seq.output_ids:  # decoding: every token but the newest has its KV
                assert seq.num_computed == len(seq.tokens) - 1
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == refs
    assert engine.stats["spec_proposed"] > engine.stats["spec_accepted"]
    assert engine.allocator.num_used_pages() == 0
    # Prompt + output again: the cached pages hold the verified tokens' KV.
    again = prompts[0] + refs[0]
    out = engine.generate([again], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert out.num_cached_prompt_tokens >= P
    assert out.outputs[0].token_ids == greedy_reference(model, again, 4)


def test_adaptive_drafts_shrink_after_rejections(model, workload):
    """With adaptive drafts a sequence whose drafts fail proposes about one token per verify
    step instead of gamma; the output stays the plain decoding's."""
    prompts, refs = workload
    fixed, got_fixed = generate(model, prompts, SpecConfig("wrong", 3), num_pages=128)
    adaptive, got = generate(model, prompts, SpecConfig("wrong", 3, adaptive=True),
                             num_pages=128)
    assert got == got_fixed == refs
    per_row = {name: e.stats["spec_proposed"] / e.stats["spec_verify_rows"]
               for name, e in (("fixed", fixed), ("adaptive", adaptive))}
    assert per_row["fixed"] > 2.5 and per_row["adaptive"] < 1.6, per_row


def test_steady_state_compiles_nothing(model, workload):
    prompts, _ = workload
    engine = Engine(model, EngineConfig(**BASE, num_pages=128, spec=SPARSE))
    engine.warmup()
    compiles = engine.num_compiles
    generate_on = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert len(generate_on) == len(prompts)
    assert engine.num_compiles == compiles


def _exact_tokens(model, prompt, temperature, top_k) -> tuple[np.ndarray, np.ndarray]:
    """(p(x1), p(x2)) with p(x2) = sum over x1 of p(x1) p(x2 | x1), tempered and top-k
    filtered."""
    def filtered(logprobs):
        logits = logprobs / temperature
        keep = np.argsort(logits)[::-1][:top_k]
        p = np.zeros_like(logits)
        p[keep] = np.exp(logits[keep] - logits[keep].max())
        return p / p.sum()

    first = filtered(dense_logprobs(model, prompt)[-1])
    second = np.zeros_like(first)
    for x1 in np.flatnonzero(first):
        second += first[x1] * filtered(dense_logprobs(model, prompt + [int(x1)])[-1])
    return first, second


@pytest.mark.parametrize("draft", ["likely", "fixed"])
def test_sampling_follows_the_model_distribution(model, draft):
    """The second token over many seeds: within a TV bound of the exact marginal, with drafts
    the model often accepts (its argmax) and drafts it mostly rejects."""
    prompt, temperature, top_k, num = [9, 30, 4, 77, 12], 1.0, 4, 1200
    first, exact = _exact_tokens(model, prompt, temperature, top_k)
    likely = {int(x1): int(np.argmax(dense_logprobs(model, prompt + [int(x1)])[-1]))
              for x1 in np.flatnonzero(first)}

    class Drafts(NoDrafts):
        name = f"test_{draft}"

        def propose(self, tokens, num_drafts):
            if len(tokens) != len(prompt) + 1:
                return []
            return [likely[tokens[-1]] if draft == "likely" else int(np.argmax(exact))]

    register_drafter(Drafts.name, Drafts)
    engine = Engine(model, EngineConfig(page_size=P, num_pages=256, max_num_seqs=32,
                                        max_num_batched_tokens=256, max_prefill_seqs=32,
                                        max_prefill_chunk=16,
                                        spec=SpecConfig(Drafts.name, num_draft_tokens=1)))
    sampling = [SamplingParams(max_new_tokens=3, temperature=temperature, top_k=top_k, seed=s,
                               ignore_eos=True) for s in range(num)]
    outs = engine.generate([prompt] * num, sampling)
    seconds = np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=128) / num
    tv = 0.5 * np.abs(seconds - exact).sum()
    stats = engine.stats
    assert stats["spec_proposed"] == num
    assert 0 < stats["spec_accepted"] < num  # both the accept and the resample branch ran
    # Sampling noise at 1200 draws over at most 16 tokens: E[TV] ~ 0.04. Accepting every
    # draft would put all mass of the "fixed" case on one token (TV ~ 1 - its probability).
    assert tv < 0.08, (tv, seconds[exact > 0], exact[exact > 0])
