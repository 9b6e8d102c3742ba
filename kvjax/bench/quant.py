"""Quality, capacity and speed of quantized KV codecs against exact KV: what
`scripts/bench_quant.py` runs; `run` is the whole benchmark.

For each codec and context length, on local English text (kvjax.bench.corpus):
  * bytes per token (all layers, K and V) and the page-pool multiplier at a fixed KV budget;
  * teacher-forced quality: the same token sequence goes through an exact engine and a
    quantized one, one sequence with logits for every position; per-token KL(exact || codec)
    (mean, p99, max), top-1 agreement, and the perplexity of the text under each;
  * a retrieval probe: a needle fact early in the prompt, asked at the end; pass when the
    greedy answer contains the value (reported for exact KV too: the small model can miss);
  * decode throughput of the probe batch (steps that compiled nothing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import numpy as np

import kvjax
from kvjax.bench.corpus import make_corpus, make_needle_prompt
from kvjax.bench.metrics import log_softmax
from kvjax.config import ModelConfig
from kvjax.engine.step import LogitsMode
from kvjax.kv import lowrank, quantized


@dataclasses.dataclass(frozen=True)
class QuantBench:
    """What one run of the codec benchmark compares, and on what.

    Attributes:
      codecs: codecs compared with exact (float32) KV: a registered name, '-cal' for
        calibrated fp8 (calibrate_kv on other corpus text), '-r<R>' for a KIVI residual
        window of R tokens; 'lowrank-r<r>' for low-rank keys of rank r calibrated on other
        corpus text ('-int8': int8 coordinates; '-emb': the engine's built-in prompts).
      contexts: teacher-forced sequence lengths in tokens.
      page_size: tokens per page, the same for every codec.
      group: group of int4/int2 (channels) and KIVI (tokens, channels).
      chunk: prefill chunk: longer contexts are scored chunk by chunk.
      budget_mib: KV budget for the capacity multiplier.
      num_probes: retrieval probes (one decode batch).
      probe_words: filler words per probe prompt.
      needle_depth: where the needle fact sits in the filler (0: start, 1: end).
      max_new_tokens: greedy tokens per probe.
      seed: corpus and probe seed.
      calibration_tokens: calibration text for '-cal' fp8 codecs.
    """

    codecs: tuple[str, ...]
    contexts: tuple[int, ...]
    page_size: int = 128
    group: int = 32
    chunk: int = 512
    budget_mib: int = 256
    num_probes: int = 4
    probe_words: int = 300
    needle_depth: float = 0.1
    max_new_tokens: int = 12
    seed: int = 0
    calibration_tokens: int = 2048


def codec_options(codec: str, page_size: int, group: int) -> dict:
    """The options each codec spec ('kivi4-r32', 'fp8_e4m3-cal', 'int4', ...) runs with."""
    name, _, suffix = codec.partition("-")
    if name == "lowrank":
        parts = suffix.split("-")
        return {"rank": int(parts[0][1:]), "quantize": "int8" if "int8" in parts else "none",
                "calibration": "embedded" if "emb" in parts else "manual"}
    if name.startswith("kivi"):
        residual = int(suffix[1:]) if suffix.startswith("r") else 0
        return {"group": group, "page_size": page_size, "residual": residual}
    if name in ("int4", "int2"):
        return {"group": group}
    if name == "int8" and suffix.startswith("g"):  # int8-g32: a scale and zero per 32 channels
        return {"group": int(suffix[1:])}
    if suffix == "cal":
        return {"scaling": "calibrated"}
    return {}


def make_engine(model: kvjax.Model, codec: str, max_len: int, settings: QuantBench
                ) -> kvjax.Engine:
    """An engine sized for one sequence of `max_len` tokens or the probe batch.

    The probes prefill in one step and decode together, and teacher-forced scoring is one
    sequence, so each engine compiles three step shapes.
    """
    page_size, num_probes, chunk = settings.page_size, settings.num_probes, settings.chunk
    options = {} if codec == "none" else codec_options(codec, page_size, settings.group)
    num_pages = num_probes * (-(-max_len // page_size) + 1) + 1
    config = kvjax.EngineConfig(
        page_size=page_size, num_pages=num_pages, kv_codec=codec.partition("-")[0],
        kv_codec_options=options,
        max_model_len=max_len + page_size, max_num_seqs=num_probes,
        max_prefill_chunk=chunk, min_chunk_bucket=chunk,
        max_num_batched_tokens=(chunk + 1) * num_probes,
        max_prefill_seqs=num_probes, enable_prefix_cache=False)
    engine = kvjax.Engine(model, config)
    if options.get("scaling") == "calibrated" or options.get("calibration") == "manual":
        text = make_text_tokens(model, settings.calibration_tokens, settings.seed + 7919)
        engine.calibrate_kv([text[i:i + 512] for i in range(0, len(text), 512)])
    return engine


def teacher_forced_logits(engine: kvjax.Engine, tokens: list[int], request_id: str
                          ) -> Iterator[np.ndarray]:
    """Logits [n, V] of consecutive prefill chunks of `tokens`: row i predicts token i + 1."""
    engine.add_request(request_id, tokens, kvjax.SamplingParams(max_new_tokens=1))
    while engine.has_unfinished():
        before = engine.stats["prefill_tokens"]
        engine.step(logits_mode=LogitsMode.ALL)
        num = engine.stats["prefill_tokens"] - before
        yield np.asarray(engine.last_logits[:num], np.float64)  # one sequence: row i = token i


def token_stats(ref: np.ndarray, test: np.ndarray, targets: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Per-token KL(ref || test), top-1 agreement and the NLL of `targets` under both."""
    kl, agree, nll_ref, nll_test = [], [], [], []
    for start in range(0, ref.shape[0], 128):  # Bounds the float64 temporaries.
        lr = log_softmax(ref[start:start + 128])  # [n, V]
        lt = log_softmax(test[start:start + 128])
        kl.append(np.maximum((np.exp(lr) * (lr - lt)).sum(-1), 0.0))  # [n]
        agree.append(lr.argmax(-1) == lt.argmax(-1))
        rows = np.arange(lr.shape[0])
        tgt = targets[start:start + 128]
        nll_ref.append(-lr[rows, tgt])
        nll_test.append(-lt[rows, tgt])
    return {k: np.concatenate(v) for k, v in
            dict(kl=kl, agree=agree, nll_ref=nll_ref, nll_test=nll_test).items()}


def score_context(model: kvjax.Model, exact: kvjax.Engine, engines: dict[str, kvjax.Engine],
                  tokens: list[int], tag: str) -> dict[str, dict[str, float]]:
    """Teacher-forced KL, agreement and perplexity of each codec engine vs `exact`."""
    targets = np.asarray(tokens[1:], np.int64)
    streams = {c: teacher_forced_logits(e, tokens, f"tf-{tag}") for c, e in engines.items()}
    per_codec: dict[str, list[dict]] = {c: [] for c in engines}
    done = 0
    for ref_chunk in teacher_forced_logits(exact, tokens, f"tf-{tag}"):
        n = min(ref_chunk.shape[0], len(targets) - done)  # The last row predicts no token.
        for codec, stream in streams.items():
            test_chunk = next(stream)
            per_codec[codec].append(token_stats(ref_chunk[:n], test_chunk[:n],
                                                targets[done:done + n]))
        done += n
    results = {}
    for codec, parts in per_codec.items():
        s = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        ppl_ref, ppl_test = np.exp(s["nll_ref"].mean()), np.exp(s["nll_test"].mean())
        results[codec] = dict(
            kl_mean=float(s["kl"].mean()), kl_p99=float(np.percentile(s["kl"], 99)),
            kl_max=float(s["kl"].max()), top1_agreement=float(s["agree"].mean()),
            ppl_exact=float(ppl_ref), ppl=float(ppl_test),
            ppl_change_pct=float(100 * (ppl_test / ppl_ref - 1)))
    return results


def make_text_tokens(model: kvjax.Model, num_tokens: int, seed: int) -> list[int]:
    """The first `num_tokens` tokens of corpus documents (`seed` picks them)."""
    docs = make_corpus(seed, 64, min_words=200, max_words=400)
    ids = model.tokenizer.encode("\n\n".join(docs))
    if len(ids) < num_tokens:
        raise ValueError(f"the corpus gave {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def make_probes(model: kvjax.Model, num: int, filler_words: int, seed: int,
                depth: float = 0.1) -> list[tuple[list[int], str]]:
    """Needle prompts (fact at `depth` of the filler) and their answers."""
    rng = np.random.default_rng(seed)
    probes = []
    for i in range(num):
        key = f"vault {chr(ord('A') + i)}"
        text, answer = make_needle_prompt(rng, filler_words, key, int(rng.integers(1000, 9999)),
                                          depth)
        probes.append((model.tokenizer.encode(text), answer))
    return probes


def run_probes(engine: kvjax.Engine, probes: list[tuple[list[int], str]], max_new_tokens: int
               ) -> dict[str, float]:
    """Retrieval pass rate and decode tokens per second (over steps that compiled nothing).

    Both per wall-clock second and per CPU second of this process: on a shared machine the
    second is the steadier of the two.
    """
    params = kvjax.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, (prompt, _) in enumerate(probes):
        engine.add_request(f"probe-{i}", prompt, params)
    outputs, decode_tokens, decode_time, decode_cpu = {}, 0, 0.0, 0.0
    while engine.has_unfinished():
        compiles, prefilled = engine.num_compiles, engine.stats["prefill_tokens"]
        decoded = engine.stats["decode_tokens"]
        start, start_cpu = time.perf_counter(), time.process_time()
        for out in engine.step():
            outputs[out.request_id] = out
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if engine.num_compiles == compiles and engine.stats["prefill_tokens"] == prefilled:
            decode_tokens += engine.stats["decode_tokens"] - decoded
            decode_time += elapsed
            decode_cpu += elapsed_cpu
    passed = [answer in outputs[f"probe-{i}"].outputs[0].text
              for i, (_, answer) in enumerate(probes)]
    return dict(retrieval_pass=float(np.mean(passed)),
                decode_tok_s=decode_tokens / decode_time if decode_time else float("nan"),
                decode_tok_cpu_s=decode_tokens / decode_cpu if decode_cpu else float("nan"))


def capacity(config: ModelConfig, codec: str, settings: QuantBench) -> dict[str, float]:
    """Bytes per token and pages in a `budget_mib` pool, vs float32 KV.

    KIVI windows (num_probes + 1 sequence slots) come out of the budget first, as in the engine.
    """
    page_size = settings.page_size
    budget = settings.budget_mib << 20
    exact = config.kv_bytes_per_token(np.float32)
    windows = 0
    if codec == "none":
        per_token = float(exact)
    elif codec.startswith("lowrank"):
        options = codec_options(codec, page_size, settings.group)
        per_token = lowrank.kv_bytes_per_token(config, quantized.make_codec("lowrank", **options))
    else:
        name, options = codec.partition("-")[0], codec_options(codec, page_size, settings.group)
        per_token = quantized.kv_bytes_per_token(config, name, **options)
        slots = quantized.num_seq_slots_for(name, settings.num_probes, **options)
        windows = quantized.residual_bytes(config, slots, name, **options)
    pages = int((budget - windows) // (per_token * page_size))
    return dict(bytes_per_token=per_token, window_bytes=windows, pages=pages,
                capacity_x=pages / int(budget // (exact * page_size)))


COLUMNS = (("bytes_per_token", "bytes/token", "{:.0f}"), ("capacity_x", "pages x", "{:.2f}"),
           ("kl_mean", "KL mean", "{:.2e}"), ("kl_p99", "KL p99", "{:.2e}"),
           ("kl_max", "KL max", "{:.2e}"), ("top1_agreement", "top-1", "{:.3f}"),
           ("ppl_change_pct", "ppl change %", "{:+.2f}"),
           ("retrieval_pass", "retrieval", "{:.2f}"), ("decode_tok_s", "decode tok/s", "{:.1f}"),
           ("decode_tok_cpu_s", "decode tok/CPU-s", "{:.1f}"))


def run(model: kvjax.Model, settings: QuantBench) -> dict[str, dict[str, float]]:
    """Every codec (and exact KV, "none") at every context, printing progress.

    Returns rows keyed "<codec>, <context>", with the `COLUMNS` keys and, for "none",
    ppl_exact.
    """
    t0 = time.perf_counter()
    codecs = ["none", *settings.codecs]
    probes = make_probes(model, settings.num_probes, settings.probe_words, settings.seed,
                         settings.needle_depth)
    print(f"probe prompts: {[len(p) for p, _ in probes]} tokens", flush=True)
    max_len = (max(max(settings.contexts), *(len(p) for p, _ in probes))
               + settings.max_new_tokens)
    engines = {c: make_engine(model, c, max_len, settings) for c in codecs}
    rows: dict[str, dict[str, float]] = {}
    for codec, engine in engines.items():
        probe = run_probes(engine, probes, settings.max_new_tokens)
        print(f"{codec}: probes {probe} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for context in settings.contexts:
            rows[f"{codec}, {context}"] = dict(**capacity(model.config, codec, settings), **probe)
    quantized_engines = {c: e for c, e in engines.items() if c != "none"}
    for context in settings.contexts:
        tokens = make_text_tokens(model, context, settings.seed + context)
        scores = score_context(model, engines["none"], quantized_engines, tokens, str(context))
        for codec, stats in scores.items():
            rows[f"{codec}, {context}"].update(stats)
        ppl = next(iter(scores.values()))["ppl_exact"]
        rows[f"none, {context}"].update(kl_mean=0.0, kl_p99=0.0, kl_max=0.0,
                                        top1_agreement=1.0, ppl_change_pct=0.0, ppl_exact=ppl)
        print(f"context {context}: scored ({time.perf_counter() - t0:.0f}s)", flush=True)
    return rows
