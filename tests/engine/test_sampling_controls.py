"""Sampling controls end to end: engine outputs with penalties, logit bias, min-p and
min_tokens equal a brute-force generate loop (the dense forward pass per token, the NumPy rules
of `sampling_reference`), under preemption, swapping, the prefix cache, n > 1, asynchronous
scheduling and speculative decoding; requests with other values compile nothing new."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_reference import generate_reference

from kvjax import EngineConfig, PreemptionMode, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason
from kvjax.scheduler.spec import NoDrafts, SpecConfig, register_drafter
from kvjax.testing import TINY, tiny_model

EOS = TINY.eos_token_ids[0]
MAX_NEW = 10
BASE = dict(page_size=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    """Prompts with repeated tokens (so the repetition penalty bites), half sharing a prefix
    (prefix-cache hits)."""
    rng = np.random.default_rng(7)
    motif = [int(t) for t in rng.integers(0, 120, size=5)]
    shared = motif * 3
    out = []
    for i in range(6):
        own = [int(t) for t in rng.integers(0, 120, size=int(rng.integers(2, 12)))]
        out.append(shared + own if i % 2 else own + motif)
    return out


def controls(i: int, *, sampled: bool) -> SamplingParams:
    """A different mix of controls per request, so the rows of a step differ."""
    sampling = dict(temperature=0.9, top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i % 3 == 0],
                    min_p=(0.0, 0.05)[i % 2 == 0], seed=100 + 10 * i) if sampled else {}
    return SamplingParams(
        max_new_tokens=MAX_NEW, presence_penalty=(0.0, 0.8, -0.5)[i % 3],
        frequency_penalty=(0.6, 0.0, 1.5)[i % 3], repetition_penalty=(1.0, 1.4, 0.7)[i % 3],
        logit_bias={(7 * i) % 120: 4.0, (11 * i + 3) % 120: -30.0}, min_tokens=i % 4,
        stop_token_ids=(EOS - 1,) if i % 2 else (), **sampling)


def generate(model, prompts, config: EngineConfig, params: list[SamplingParams]):
    engine = Engine(model, config)
    outs = engine.generate(prompts, params)
    return engine, outs


def references(model, prompts, params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[generate_reference(model, prompt, p, p.seed + k if p.seed is not None else 0)
             for k in range(p.n)] for prompt, p in zip(prompts, params, strict=True)]


CONFIGS = {
    "plenty": dict(num_pages=256),
    "recompute": dict(num_pages=24),
    "swap": dict(num_pages=24, preemption_mode=PreemptionMode.SWAP),
    "async": dict(num_pages=256, async_scheduling=True),
    "async-recompute": dict(num_pages=24, async_scheduling=True),
    "small-chunks": dict(num_pages=256, max_prefill_chunk=3, max_num_batched_tokens=9),
}


# Every behaviour keeps a fast case; the other combinations run in `make test-slow`.
FAST = {("recompute", True), ("async-recompute", False)}


@pytest.mark.parametrize("name,sampled", [
    pytest.param(name, sampled, id=f"{name}-{'seeded' if sampled else 'greedy'}",
                 marks=() if (name, sampled) in FAST else pytest.mark.slow)
    for name in CONFIGS for sampled in (False, True)])
def test_controls_equal_the_brute_force_loop(model, prompts, name, sampled):
    params = [controls(i, sampled=sampled) for i in range(len(prompts))]
    engine, outs = generate(model, prompts, EngineConfig(**{**BASE, **CONFIGS[name]}), params)
    want = references(model, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    if name in ("recompute", "swap", "async-recompute"):
        assert engine.stats["preemptions"] > 0, "the pool was meant to force preemption"
    if name == "plenty":
        assert engine.prefix_cache_stats()["prefix_hit_tokens"] > 0
    # The penalties changed something: plain decoding gives other tokens.
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in plain] != [w[0] for w in want]


def test_parallel_samples_count_their_own_outputs(model, prompts):
    """n > 1: each sample forks after the shared prompt and penalizes its own tokens only."""
    p = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5, n=3,
                       frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.3)
    _, outs = generate(model, prompts[:2], EngineConfig(**BASE, num_pages=256), [p, p])
    want = references(model, prompts[:2], [p, p])
    assert [[c.token_ids for c in o.outputs] for o in outs] == want


class ReplayDrafts(NoDrafts):
    """Proposes the continuation of a known sequence (the reference outputs), with the last
    draft replaced by a wrong token at every third length, so verify steps both keep drafts
    that only the rules make right and reject some."""

    name = "replay"

    def __init__(self, sequences: tuple[tuple[int, ...], ...] = ()):
        self.sequences = sequences

    def propose(self, tokens, num):
        tokens = list(tokens)
        for full in self.sequences:
            if list(full[:len(tokens)]) == tokens and len(full) > len(tokens):
                drafts = list(full[len(tokens):len(tokens) + num])
                if drafts and len(tokens) % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 120
                return drafts
        return []


register_drafter("replay", ReplayDrafts)


@pytest.mark.parametrize("is_async", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["sync", "async"])
def test_speculative_verification_applies_the_rules(model, prompts, is_async):
    """Greedy verify steps: each draft position sees the counts with the earlier drafts.
    The drafts are the reference's own tokens, so a position that missed an earlier draft in
    its counts would pick another token and the output would leave the reference."""
    params = [controls(i, sampled=False) for i in range(len(prompts))]
    want = references(model, prompts, params)
    sequences = tuple(tuple(p + w[0]) for p, w in zip(prompts, want, strict=True))
    engine, outs = generate(model, prompts, EngineConfig(
        **BASE, num_pages=256, async_scheduling=is_async,
        spec=SpecConfig("replay", num_draft_tokens=3, options=dict(sequences=sequences))),
        params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    stats = engine.stats
    assert stats["spec_proposed"] > stats["spec_accepted"] > 0.5 * stats["spec_proposed"]


@pytest.mark.parametrize("sampled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["greedy", "seeded"])
def test_min_tokens_keeps_eos_and_stop_tokens_away(model, prompts, sampled):
    """EOS is pushed to the top by a bias, and a stop token with it: neither appears before
    min_tokens tokens, and the first token after them ends the request."""
    extra = dict(temperature=0.7, seed=3) if sampled else {}
    params = [SamplingParams(max_new_tokens=12, min_tokens=k, logit_bias={EOS: 100.0},
                             **extra) for k in (0, 1, 5, 12)]
    params.append(SamplingParams(max_new_tokens=12, min_tokens=4, stop_token_ids=(9,),
                                 ignore_eos=True, logit_bias={9: 100.0, EOS: 50.0}, **extra))
    _, outs = generate(model, prompts[:5], EngineConfig(**BASE, num_pages=256), params)
    got = [o.outputs[0] for o in outs]
    assert [c.token_ids for c in got[:4]] == [r[0] for r in references(
        model, prompts[:4], params[:4])]
    for c, k in zip(got[:3], (0, 1, 5), strict=True):
        assert len(c.token_ids) == k + 1 and c.token_ids[-1] == EOS
        assert EOS not in c.token_ids[:-1] and c.finish_reason is FinishReason.STOP
    assert EOS not in got[3].token_ids and got[3].finish_reason is FinishReason.LENGTH
    # ignore_eos: EOS is an ordinary token (biased up, it is generated), the stop token waits.
    assert got[4].token_ids[:4] == [EOS] * 4 and got[4].token_ids[4] == 9


def test_bad_controls_fail_alone(model, prompts, monkeypatch):
    """Logit-bias ids outside the vocabulary, and more bias entries than a step row holds,
    are ValueErrors naming the request; the engine keeps serving."""
    engine = Engine(model, EngineConfig(**BASE, num_pages=64))
    with pytest.raises(ValueError, match="request 'r'.*logit_bias token id 500 is outside"):
        engine.add_request("r", prompts[0], SamplingParams(logit_bias={500: 1.0}))
    # The tiny vocabulary cannot overflow the real width: shrink it.
    monkeypatch.setattr("kvjax.engine.intake.BIAS_WIDTH", 8)
    with pytest.raises(ValueError, match="request 's'.*take 9 entries, more than 8"):
        engine.add_request("s", prompts[0], SamplingParams(
            logit_bias={i: 1.0 for i in range(5)}, min_tokens=1, stop_token_ids=(1, 2, 3)))
    engine.add_request("ok", prompts[0], SamplingParams(  # 8 entries: EOS merged with a stop
        max_new_tokens=3, logit_bias={i: 1.0 for i in range(5)}, min_tokens=3,
        stop_token_ids=(1, 2, EOS)))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"]  # the refused ones never ran
    assert len(finished[0].outputs[0].token_ids) == 3


def test_compile_count_flat_when_controls_change(model):
    """Warm-up compiles the one variant with rules per step shape; requests with any values
    of the controls then compile nothing."""
    rng = np.random.default_rng(4)
    engine = Engine(model, EngineConfig(page_size=4, max_num_batched_tokens=16,
                                        max_prefill_chunk=16, max_num_seqs=2,
                                        max_prefill_seqs=1, num_pages=64, max_model_len=64))
    warm = engine.warmup(sampling=True)
    for i in range(24):
        p = SamplingParams(
            max_new_tokens=int(rng.integers(1, 8)), temperature=float(rng.choice([0, 0.8])),
            presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(
                rng.uniform(-2, 2)), repetition_penalty=float(rng.uniform(0.5, 2)),
            logit_bias={int(t): float(rng.uniform(-100, 100))
                        for t in rng.integers(0, 128, size=int(rng.integers(0, 300)))},
            min_p=float(rng.choice([0, 0.1])), min_tokens=0, seed=i)
        prompt = [int(t) for t in rng.integers(0, 120, size=int(rng.integers(1, 30)))]
        engine.add_request(f"q{i}", prompt, p)
        if rng.random() < 0.5:
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert engine.num_compiles == warm, f"recompiled after warm-up: {warm} -> " \
        f"{engine.num_compiles}"
