"""Speculative decoding under retention policies and KIVI is lossless: greedy tokens and their
logprobs equal the same engine's without drafts.

Oracle: the same engine configuration with speculation off (plain decoding, whose retention
decisions and KIVI group aging run after every token). A verify row reads what each of its
tokens' decode steps would read only if no eviction and no key group's aging falls inside it,
so the drafts come from a drafter that replays the plain run's own tokens (drafts are
accepted, rows run into eviction and aging boundaries) with some drafts corrupted (so rows
are also rolled back), besides prompt-lookup drafts and self-drafts (whose draft steps write
the sequence's slots before the verify). Logprobs are compared too: a query that
read one token more or less than its plain decode step would, or a group quantized one step
early, moves them by far more than the tolerance, even where the greedy token survives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvjax import EngineConfig, SamplingParams
from kvjax.engine.engine import Engine
from kvjax.scheduler.spec import NoDrafts, SpecConfig, register_drafter
from kvjax.testing import tiny_model

P = 4
NEW = 16
GAMMA = 3
BASE = dict(page_size=P, num_pages=96, max_num_batched_tokens=32, max_prefill_chunk=16,
            max_num_seqs=3, enable_prefix_cache=False, debug_provenance=True)
# The verify path attends through the prefill kernel, plain decoding through the decode one:
# their float32 sums differ in order only.
LOGPROB_ATOL = 2e-4
CASES = {
    "streaming": dict(retention="streaming", retention_budget=10,
                      retention_options=dict(num_sinks=2)),
    "streaming_rotated": dict(retention="streaming", retention_budget=10,
                              retention_options=dict(num_sinks=2, cache_positions=True)),
    "h2o": dict(retention="h2o", retention_budget=10, retention_options=dict(num_recent=3)),
    "tova": dict(retention="tova", retention_budget=10),
    "snapkv": dict(retention="snapkv", retention_budget=10,
                   retention_options=dict(window=3, kernel=3)),
    "knorm": dict(retention="knorm", retention_budget=10),
    "expected_attention": dict(retention="expected_attention", retention_budget=10,
                               retention_options=dict(num_sinks=2, num_future=16)),
    "observed_attention": dict(retention="observed_attention", retention_budget=10),
    "kivi": dict(kv_codec="kivi4", kv_codec_options=dict(group=4)),
    "kivi_residual": dict(kv_codec="kivi4", kv_codec_options=dict(group=4, residual=4)),
    "kivi_residual+h2o": dict(kv_codec="kivi4", kv_codec_options=dict(group=4, residual=4),
                              retention="h2o", retention_budget=10,
                              retention_options=dict(num_recent=3)),
}


class ReplayDrafts(NoDrafts):
    """Proposes the tokens a plain run produced after the same tokens, corrupting one draft
    in two proposals out of three (so rows keep 0 .. gamma drafts)."""

    name = "replay_plain"

    def __init__(self, runs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] = ()):
        self.runs = [(list(prompt), list(out)) for prompt, out in runs]

    def propose(self, tokens: Sequence[int], num: int) -> list[int]:
        tokens = list(tokens)
        for prompt, out in self.runs:
            if tokens[:len(prompt)] == prompt and tokens[len(prompt):] == out[:len(tokens)
                                                                              - len(prompt)]:
                drafts = out[len(tokens) - len(prompt):][:num]
                if drafts and len(tokens) % 3:
                    wrong = len(tokens) % len(drafts)
                    drafts[wrong] = (drafts[wrong] + 1) % 120 + 2
                return drafts
        return []


register_drafter("replay_plain", ReplayDrafts)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    """Two prompts with repeats (prompt lookup finds matches), longer than the budget, of one
    length (few step shapes to compile)."""
    rng = np.random.default_rng(7)
    motif = [int(t) for t in rng.integers(2, 120, size=5)]
    return [motif * 2 + [int(t) for t in rng.integers(2, 120, size=4)] + motif[:3]
            for _ in range(2)]


def serve(model, prompts, overrides, spec, *, warm=False):
    """(engine, outputs, compiles after warm-up) of serving `prompts` twice over: the second
    pass must compile nothing and give the same tokens (no prefix cache: it recomputes)."""
    engine = Engine(model, EngineConfig(**BASE, **overrides, spec=spec))
    if warm:
        engine.warmup()
    compiles = engine.num_compiles
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outs = [o.outputs[0] for o in engine.generate(prompts, sampling)]
    if not warm:
        compiles = engine.num_compiles
    again = [o.outputs[0].token_ids for o in engine.generate(prompts, sampling)]
    assert again == [o.token_ids for o in outs]
    return engine, outs, engine.num_compiles - compiles


def _replay(want, prompts) -> SpecConfig:
    runs = tuple((tuple(p), tuple(o.token_ids)) for p, o in zip(prompts, want, strict=True))
    return SpecConfig("replay_plain", GAMMA, options=dict(runs=runs))


# Self-drafts write their own K/V into the sequence's slots in draft steps before the verify.
SELF_DRAFTED = ("streaming", "h2o", "kivi", "kivi_residual")


@pytest.mark.parametrize("case,drafts", [(c, d) for c in CASES for d in ("replay", "ngram")]
                         + [(c, "sparse_self") for c in SELF_DRAFTED])
def test_verify_steps_keep_plain_decodings_tokens(model, prompts, case, drafts):
    overrides = CASES[case]
    plain, want, _ = serve(model, prompts, overrides, SpecConfig())
    spec = {"replay": lambda: _replay(want, prompts),
            "ngram": lambda: SpecConfig("ngram", GAMMA),
            "sparse_self": lambda: SpecConfig("sparse_self", GAMMA,
                                              options=dict(num_sinks=P, window=2 * P))}[drafts]()
    engine, got, new_compiles = serve(model, prompts, overrides, spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                               np.concatenate([o.logprobs for o in want]), atol=LOGPROB_ATOL)
    assert new_compiles == 0, "the second pass compiled"
    stats = engine.stats
    if drafts != "ngram":  # prompt lookup proposes only where the output repeats itself
        assert stats["spec_proposed"] > 0
    if drafts == "replay":
        assert 0 < stats["spec_proposed"] - stats["spec_accepted"], "no draft rejected"
        assert stats["spec_accepted"] > 0, "no draft kept"
    retention = engine.kv_cache.retention
    if retention.policy.evicts:  # the evictions plain decoding made, no more, no fewer
        assert retention.stats["evictions"] > 0
        for key in ("evictions", "evicted_tokens"):
            assert retention.stats[key] == plain.kv_cache.retention.stats[key], key
    assert stats["stale_kv_reads"] == 0
    assert engine.allocator.num_used_pages() == 0


@pytest.mark.parametrize("case", ["h2o", "kivi"])
def test_warmed_engine_compiles_nothing_while_verifying(model, prompts, case):
    """Warm-up covers the verify steps' per-query key scores and KIVI's verify rows."""
    _, want, _ = serve(model, prompts, CASES[case], SpecConfig())
    engine, got, new_compiles = serve(model, prompts, CASES[case], _replay(want, prompts),
                                      warm=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert new_compiles == 0
