"""Structured outputs in the engine: a request with a grammar emits exactly what a brute-force
loop emits (the dense forward pass per token, its logits masked by an independent llguidance
matcher, argmax), its output matches the grammar (jsonschema, re.fullmatch, the choices), with
asynchronous scheduling, n > 1, speculative decoding and the prefix cache; masks compile
nothing after warm-up; a bad grammar is a ValueError naming the request."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest
from sampling_reference import dense_logits

import kvjax.grammar
from kvjax import Engine, EngineConfig, SamplingParams
from kvjax.grammar import Grammar, GrammarKind, fill_masks
from kvjax.scheduler.spec import SpecConfig
from kvjax.testing import greedy_reference, tiny_chat_model

llguidance = pytest.importorskip("llguidance")
import llguidance.numpy as llg_numpy  # noqa: E402

CONFIG = dict(page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
              max_prefill_chunk=32, min_chunk_bucket=32, max_prefill_seqs=1)
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "n"], "additionalProperties": False}
REGEX = "[a-c]{2,4}-[0-9]"
CHOICES = ["yes", "no", "maybe"]
GRAMMARS = [Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
            Grammar(GrammarKind.REGEX, REGEX), Grammar.choice(CHOICES)]
MAX_NEW = 40


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def prompts(model):
    return [model.tokenizer.encode(t) for t in ("Reply in JSON.", "a code:", "yes or no?")]


def check_matches(grammar: Grammar, text: str) -> None:
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif grammar.kind is GrammarKind.REGEX:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


def masked_greedy_reference(model, prompt: list[int], grammar: Grammar) -> list[int]:
    """Greedy decoding by brute force under the grammar: a fresh llguidance matcher, the
    dense model's logits masked with llguidance's own numpy kernel, argmax."""
    vocab = model.config.vocab_size
    lib_tokenizer = llguidance.LLTokenizer(model.tokenizer.backend.to_str(), n_vocab=vocab,
                                           eos_token=list(model.config.eos_token_ids))
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            grammar.source, defaults={"whitespace_flexible": False})
    else:
        text = llguidance.grammar_from(grammar.kind.value, grammar.source)
    matcher = llguidance.LLMatcher(lib_tokenizer, text)
    output: list[int] = []
    while len(output) < MAX_NEW and not matcher.is_stopped():
        logits = dense_logits(model, prompt + output)[None].astype(np.float32)
        mask = llg_numpy.allocate_token_bitmask(1, vocab)
        llg_numpy.fill_next_token_bitmask(matcher, mask)
        llg_numpy.apply_token_bitmask_inplace(logits, mask)
        output.append(int(np.argmax(logits[0])))
        assert matcher.consume_token(output[-1])
    return output


@pytest.fixture(scope="module")
def references(model, prompts):
    return [masked_greedy_reference(model, p, g) for p, g in zip(prompts, GRAMMARS, strict=True)]


@pytest.fixture
def parallel_fill(monkeypatch):
    """Steps with several constrained rows fill their masks on a 2-thread pool (the default
    pool has one thread on a 2-core host, which fills them one by one)."""
    monkeypatch.setattr(kvjax.grammar, "pool_threads", lambda: 2)


def test_greedy_equals_masked_reference_without_new_compiles(engine, model, prompts,
                                                             references, parallel_fill):
    compiles = engine.num_compiles
    params = [SamplingParams(max_new_tokens=MAX_NEW, grammar=g) for g in GRAMMARS]
    # Unconstrained rows share the steps: their outputs must not change.
    free = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    outs = engine.generate(prompts + prompts, params + [SamplingParams(max_new_tokens=8)] * 3)
    for out, ref, grammar in zip(outs[:3], references, GRAMMARS, strict=True):
        tokens = out.outputs[0].token_ids
        assert tokens == ref
        assert out.outputs[0].finish_reason.value == "stop"
        check_matches(grammar, model.tokenizer.decode(tokens))
    assert [o.outputs[0].token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in free]
    assert engine.num_compiles == compiles, "a grammar compiled a step program"


@pytest.mark.parametrize("overrides", [
    dict(async_scheduling=False),
    dict(spec=SpecConfig("ngram", num_draft_tokens=3)),
], ids=["sync", "ngram_spec"])
def test_greedy_composes(model, prompts, references, overrides, parallel_fill):
    engine = Engine(model, EngineConfig(**dict(CONFIG, **overrides)))
    # Twice: the second time the prompts hit the prefix cache. An unconstrained request
    # beside them (drafted and verified under speculation) keeps its greedy tokens.
    free = greedy_reference(model, prompts[0], 8, stop=model.config.eos_token_ids)
    for _ in range(2):
        outs = engine.generate(prompts + prompts[:1], [
            SamplingParams(max_new_tokens=MAX_NEW, grammar=g) for g in GRAMMARS
        ] + [SamplingParams(max_new_tokens=8)])
        assert [o.outputs[0].token_ids for o in outs] == references + [free]
    assert engine.metrics()["prefix_hit_tokens"] > 0
    if engine.config.spec.enabled:
        assert engine.stats["spec_proposed"] > 0, "the unconstrained row drafted nothing"
        # Constrained rows alone: they draft too, each draft checked against the grammar's
        # mask after the drafts before it; sampled outputs still follow the grammar.
        accepted = engine.stats["spec_accepted"]
        outs = engine.generate(prompts, [SamplingParams(max_new_tokens=MAX_NEW, grammar=g)
                                         for g in GRAMMARS])
        assert [o.outputs[0].token_ids for o in outs] == references
        assert engine.stats["spec_accepted"] > accepted, "no constrained draft was accepted"
        outs = engine.generate(prompts, [SamplingParams(max_new_tokens=MAX_NEW, grammar=g,
                                                        temperature=1.0, seed=7)
                                         for g in GRAMMARS])
        for out, grammar in zip(outs, GRAMMARS, strict=True):
            check_matches(grammar, model.tokenizer.decode(out.outputs[0].token_ids))


def test_masks_after_drafts_equal_the_matcher_stepped_token_by_token(engine, model,
                                                                     references):
    """`GrammarMatcher.masks(drafts)`: row j is the mask after drafts[:j] (a fork stepped
    one token at a time), rows past a forbidden draft are empty, and the matcher is where
    it was."""
    matcher = engine.grammar_matcher("m", GRAMMARS[0])
    drafts = references[0][:4]
    before = matcher.mask()
    masks = matcher.masks(drafts)
    step = matcher.fork()
    for j in range(len(drafts) + 1):
        np.testing.assert_array_equal(masks[j], step.mask())
        if j < len(drafts):
            step.accept(drafts[j])
    np.testing.assert_array_equal(matcher.mask(), before)
    forbidden = next(t for t in range(128) if not (before[t // 32] >> (t % 32)) & 1)
    masks = matcher.masks([forbidden, drafts[0]])
    np.testing.assert_array_equal(masks[0], before)
    assert not masks[1:].any()
    # Drafts through the end of the output, then EOS: the matcher stops on the way and is
    # rolled back by what it consumed, so it is where it was (and answers the same again).
    drafts = references[1] + list(model.config.eos_token_ids)
    regex = engine.grammar_matcher("m", GRAMMARS[1])
    start = regex.mask()
    first = regex.masks(drafts)
    assert first[len(references[1]) - 1].any()  # the last output token is allowed there
    np.testing.assert_array_equal(regex.mask(), start)
    np.testing.assert_array_equal(regex.masks(drafts), first)


def test_masks_filled_together_equal_each_row_alone(engine, model, references):
    """`fill_masks` on llguidance's thread pool (what a step with several constrained rows
    uses on a host with cores to spare) gives each row what its own `masks(drafts)` gives,
    drafts valid, forbidden or past the end of the output included, and leaves every
    matcher where it was."""
    rng = np.random.default_rng(0)
    for _ in range(12):
        rows = []
        for _ in range(int(rng.integers(2, 9))):
            g = int(rng.integers(len(GRAMMARS)))
            pos = int(rng.integers(len(references[g])))
            matcher = engine.grammar_matcher("m", GRAMMARS[g])
            for token in references[g][:pos]:
                matcher.accept(token)
            drafts = list(references[g][pos:pos + int(rng.integers(0, 5))])
            if drafts and rng.random() < 0.3:
                drafts[int(rng.integers(len(drafts)))] = int(
                    rng.integers(model.config.vocab_size))
            if rng.random() < 0.2:
                drafts += list(model.config.eos_token_ids)
            rows.append((matcher, drafts))
        alone = [matcher.masks(drafts) for matcher, drafts in rows]
        together = fill_masks(rows, num_threads=2)
        assert len(together) == len(rows)
        for (matcher, _), a, b in zip(rows, alone, together, strict=True):
            np.testing.assert_array_equal(b, a)
            np.testing.assert_array_equal(matcher.mask(), a[0])


def test_swapped_out_mid_output_and_back(model, prompts, references):
    engine = Engine(model, EngineConfig(**CONFIG))
    for i, (p, g) in enumerate(zip(prompts, GRAMMARS, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW, grammar=g))
    done = {}
    for _ in range(4):
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    live = engine.scheduler.request_ids()
    for request_id in live:
        engine.pause(request_id, to_host=True)
    engine.step()
    for request_id in live:
        engine.resume(request_id)
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert [done[f"r{i}"] for i in range(3)] == references


def test_sampled_n_samples_each_match(engine, model, prompts):
    params = [SamplingParams(max_new_tokens=MAX_NEW, grammar=g, temperature=1.5, seed=5, n=6)
              for g in GRAMMARS]
    for out, grammar in zip(engine.generate(prompts, params), GRAMMARS, strict=True):
        assert all(s.finish_reason.value == "stop" for s in out.outputs)
        texts = [model.tokenizer.decode(s.token_ids) for s in out.outputs]
        for text in texts:
            check_matches(grammar, text)
        assert len(set(texts)) > 1 or grammar.kind is GrammarKind.CHOICE


@pytest.mark.parametrize("grammar, message", [
    (Grammar(GrammarKind.JSON_SCHEMA, '{"type": "nope"}'), "invalid json_schema"),
    (Grammar(GrammarKind.REGEX, "[a-"), "invalid regex"),
    (Grammar(GrammarKind.CHOICE, "[1, 2]"), "invalid choice"),
])
def test_bad_grammar_is_refused_and_engine_keeps_serving(engine, prompts, grammar, message):
    with pytest.raises(ValueError, match=rf"request 'bad'.*{message}"):
        engine.add_request("bad", prompts[0], SamplingParams(grammar=grammar))
    out = engine.generate([prompts[0]], SamplingParams(max_new_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_snapshot_mid_output_resumes_under_the_grammar(model, prompts, references, tmp_path):
    from kvjax.engine.snapshot import restore_snapshot, save_snapshot

    source = Engine(model, EngineConfig(**CONFIG))
    for i, (p, g) in enumerate(zip(prompts, GRAMMARS, strict=True)):
        source.add_request(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW, grammar=g))
    for _ in range(4):
        source.step()
    source.drain()
    assert all(s.output_ids for s in source.scheduler.sequences()), "snapshot mid-output"
    save_snapshot(source, tmp_path / "snap")
    target = Engine(model, EngineConfig(**CONFIG))
    restore_snapshot(target, tmp_path / "snap")
    done = {}
    while target.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in target.step()})
    assert [done[f"r{i}"] for i in range(3)] == references


def test_without_llguidance_a_grammar_is_refused_saying_so(model, monkeypatch):
    from kvjax.grammar import GrammarCompiler

    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` fails
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, [127])
    with pytest.raises(ValueError, match=r"optional extra: pip install 'kvjax\[grammar\]'"):
        compiler.matcher(GRAMMARS[1])
