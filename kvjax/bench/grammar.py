"""What structured outputs cost: decode throughput of grammar-constrained requests beside
unconstrained ones on one engine, the host's mask time per token, and the device's masking.

Three request mixes decode the same prompts on one warmed engine (asynchronous scheduling on),
taking turns round by round: `free` (no grammar), `json` (every request under a JSON schema
that cannot end before `new_tokens`) and `mixed` (half of each). Constrained steps are
synchronous (the next mask needs the sampled token on the host), so `json` pays the host's
mask time and the lost overlap; `mixed` (more than one request) shows what that costs the
unconstrained rows beside them. Every step, constrained or not, ships one token bitmask per
row and applies it on the device: `apply_mask_ms` times that alone (a jitted
`apply_token_mask` over [B, V] logits). `fill_ms` times building one step's masks for
several constrained rows one after another against llguidance's parallel fill.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.grammar import Grammar, GrammarCompiler, GrammarKind, fill_masks, mask_width
from kvjax.models.model import Model
from kvjax.sampling import SamplingParams, apply_token_mask

SCHEMA = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}},
    "required": ["notes"], "additionalProperties": False}
MIXES = ("free", "json", "mixed")


def _prompts(model: Model, batch: int) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.encode(tok.apply_chat_template([dict(
        role="user", content=f"Write notes about city number {i} as JSON.")]))
        for i in range(batch)]


def _samplings(mix: str, batch: int, new_tokens: int) -> list[SamplingParams]:
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    constrained = {"free": 0, "json": batch, "mixed": batch // 2}[mix]
    return [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                           grammar=grammar if i < constrained else None)
            for i in range(batch)]


def _mask_ms(model: Model, tokens: Sequence[int]) -> float:
    """Mean host time (ms) of one mask, over the positions of a constrained output."""
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size,
                               model.config.eos_token_ids)
    matcher = compiler.matcher(Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    start = time.perf_counter()
    for token in tokens:
        matcher.mask()
        matcher.accept(token)
    return 1e3 * (time.perf_counter() - start) / max(len(tokens), 1)


def _notes_tokens(model: Model, num_notes: int) -> list[int]:
    """A JSON text that follows SCHEMA, as tokens (what a constrained output looks like)."""
    notes = ",".join(f'"note {i % 100}"' for i in range(num_notes))
    return model.tokenizer.encode('{"notes":[' + notes + "]}")


def fill_ms(model: Model, *, num_rows: int, num_threads: int, num_steps: int = 32,
            repeats: int = 3) -> dict:
    """Host time (ms) to build one step's masks for `num_rows` constrained rows: one row after
    another (`GrammarMatcher.masks`) and together (`kvjax.grammar.fill_masks` on llguidance's
    pool of `num_threads` threads), best of `repeats` passes of `num_steps` steps. The rows
    sit at staggered positions of a JSON output under SCHEMA and advance one token per step;
    both ways give the same masks (checked)."""
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size,
                               model.config.eos_token_ids)
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    tokens = _notes_tokens(model, SCHEMA["properties"]["notes"]["minItems"])
    best = {"serial": float("inf"), "parallel": float("inf")}
    for _ in range(repeats):
        # Each way has matchers of its own: a matcher keeps the mask it computed last.
        rows = {way: [compiler.matcher(grammar) for _ in range(num_rows)] for way in best}
        for matchers in rows.values():
            for i, matcher in enumerate(matchers):
                for token in tokens[:3 * i]:
                    matcher.accept(token)
        spent = {"serial": 0.0, "parallel": 0.0}
        for step in range(num_steps):
            start = time.perf_counter()
            alone = [m.masks(()) for m in rows["serial"]]
            spent["serial"] += time.perf_counter() - start
            start = time.perf_counter()
            together = fill_masks([(m, ()) for m in rows["parallel"]], num_threads=num_threads)
            spent["parallel"] += time.perf_counter() - start
            if any(not np.array_equal(a, b) for a, b in zip(alone, together, strict=True)):
                raise RuntimeError("the parallel fill differs from the serial one")
            for matchers in rows.values():
                for i, matcher in enumerate(matchers):
                    matcher.accept(tokens[3 * i + step])
        best = {k: min(best[k], 1e3 * spent[k] / num_steps) for k in best}
    return dict(num_rows=num_rows, num_threads=num_threads, serial_ms=round(best["serial"], 3),
                parallel_ms=round(best["parallel"], 3),
                speedup=round(best["serial"] / best["parallel"], 2))


def format_fill_table(results: list[dict]) -> str:
    lines = ["| constrained rows | pool threads | serial ms/step | parallel ms/step | speed-up |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['num_rows']} | {r['num_threads']} | {r['serial_ms']} | {r['parallel_ms']} "
              f"| {r['speedup']} |" for r in results]
    return "\n".join(lines)


def _apply_mask_ms(batch: int, vocab: int, repeats: int = 50) -> float:
    """Device time (ms) of masking [batch, vocab] logits, jitted alone."""
    fn = jax.jit(apply_token_mask)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, vocab)), jnp.float32)
    masks = jnp.full((batch, mask_width(vocab)), -1, jnp.int32)
    fn(logits, masks).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(logits, masks)
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - start) / repeats


def run(model: Model, *, batch_sizes: Sequence[int], new_tokens: int, rounds: int,
        page_size: int = 16) -> dict:
    """Tokens/s of each mix at each batch size (best of `rounds`), mask timings."""
    results = []
    for batch in batch_sizes:
        prompts = _prompts(model, batch)
        longest = max(map(len, prompts)) + new_tokens
        engine = Engine(model, EngineConfig(
            page_size=page_size, num_pages=batch * (longest // page_size + 2),
            max_num_seqs=batch, max_num_batched_tokens=max(256, batch),
            max_prefill_chunk=256, max_model_len=longest + page_size))
        warm = engine.warmup()
        mixes = MIXES if batch > 1 else MIXES[:2]
        best = {mix: 0.0 for mix in mixes}
        json_tokens: list[int] = []
        for _ in range(rounds):
            for mix in mixes:
                start = time.perf_counter()
                outs = engine.generate(prompts, _samplings(mix, batch, new_tokens))
                elapsed = time.perf_counter() - start
                num = sum(len(s.token_ids) for o in outs for s in o.outputs)
                best[mix] = max(best[mix], num / elapsed)
                if mix == "json":
                    json_tokens = outs[0].outputs[0].token_ids
                    text = model.tokenizer.decode(json_tokens)
                    if not text.startswith('{"notes":["'):
                        raise RuntimeError(f"constrained output does not follow the schema: "
                                           f"{text[:40]!r}")
        results.append(dict(
            batch=batch, tokens_per_s={m: round(v, 1) for m, v in best.items()},
            ratio_to_free={m: round(v / best["free"], 3) for m, v in best.items()},
            mask_ms_per_token=round(_mask_ms(model, json_tokens), 3),
            apply_mask_ms=round(_apply_mask_ms(batch, model.config.vocab_size), 3),
            step_ms_free=round(1e3 * batch / best["free"], 2),
            compiles_after_warmup=engine.num_compiles - warm))
    return dict(results=results)


def format_table(results: list[dict]) -> str:
    lines = ["| batch | free tok/s | json tok/s (ratio) | mixed tok/s (ratio) | host mask ms/token "
             "| device mask ms/step | free step ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        t, q = r["tokens_per_s"], r["ratio_to_free"]
        mixed = f"{t['mixed']} ({q['mixed']})" if "mixed" in t else "-"
        lines.append(f"| {r['batch']} | {t['free']} | {t['json']} ({q['json']}) | {mixed} | "
                     f"{r['mask_ms_per_token']} | {r['apply_mask_ms']} | {r['step_ms_free']} |")
    return "\n".join(lines)
