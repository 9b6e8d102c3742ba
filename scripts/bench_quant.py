"""Quality, capacity and speed of quantized KV codecs on the embedded model, against exact KV.

  python scripts/bench_quant.py --output_json /tmp/bench_quant.json

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

import json
import time
from collections.abc import Iterator

import numpy as np
from absl import app, flags

import kvjax
from kvjax.bench.corpus import make_corpus, make_needle_prompt
from kvjax.bench.metrics import format_rows
from kvjax.engine.step import LogitsMode
from kvjax.kv import quantized

FLAGS = flags.FLAGS
flags.DEFINE_list("codecs", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3-cal", "fp8_e5m2-cal",
                            "int4", "int2", "kivi4", "kivi2", "kivi4-r32", "kivi2-r32",
                            "kivi4-r128", "kivi2-r128"],
                  "Codecs to compare with exact (float32) KV: a registered name, '-cal' for "
                  "calibrated fp8 (calibrate_kv on other corpus text), '-r<R>' for a KIVI "
                  "residual window of R tokens.")
flags.DEFINE_integer("calibration_tokens", 2048, "Calibration text for '-cal' fp8 codecs.")
flags.DEFINE_list("contexts", ["512", "2048"], "Teacher-forced sequence lengths in tokens.")
flags.DEFINE_integer("page_size", 128, "Tokens per page, the same for every codec.")
flags.DEFINE_integer("group", 32, "Group of int4/int2 (channels) and KIVI (tokens, channels).")
flags.DEFINE_integer("chunk", 512, "Prefill chunk: longer contexts are scored chunk by chunk.")
flags.DEFINE_integer("budget_mib", 256, "KV budget for the capacity multiplier.")
flags.DEFINE_integer("num_probes", 4, "Retrieval probes (one decode batch).")
flags.DEFINE_integer("probe_words", 300, "Filler words per probe prompt.")
flags.DEFINE_float("needle_depth", 0.1, "Where the needle fact sits in the filler (0: start, "
                   "1: end).")
flags.DEFINE_integer("max_new_tokens", 12, "Greedy tokens per probe.")
flags.DEFINE_integer("seed", 0, "Corpus and probe seed.")
flags.DEFINE_string("output_json", None, "Write every number here.")


def codec_options(codec: str, page_size: int, group: int) -> dict:
    """The options each codec spec ('kivi4-r32', 'fp8_e4m3-cal', 'int4', ...) runs with."""
    name, _, suffix = codec.partition("-")
    if name.startswith("kivi"):
        residual = int(suffix[1:]) if suffix.startswith("r") else 0
        return {"group": group, "page_size": page_size, "residual": residual}
    if name in ("int4", "int2"):
        return {"group": group}
    if suffix == "cal":
        return {"scaling": "calibrated"}
    return {}


def make_engine(model: kvjax.Model, codec: str, max_len: int) -> kvjax.Engine:
    """An engine sized for one sequence of `max_len` tokens or the probe batch.

    The probes prefill in one step and decode together, and teacher-forced scoring is one
    sequence, so each engine compiles three step shapes.
    """
    page_size = FLAGS.page_size
    options = {} if codec == "none" else codec_options(codec, page_size, FLAGS.group)
    num_pages = FLAGS.num_probes * (-(-max_len // page_size) + 1) + 1
    config = kvjax.EngineConfig(
        page_size=page_size, num_pages=num_pages, kv_codec=codec.partition("-")[0],
        kv_codec_options=options,
        max_model_len=max_len + page_size, max_num_seqs=FLAGS.num_probes,
        max_prefill_chunk=FLAGS.chunk, min_chunk_bucket=FLAGS.chunk,
        max_num_batched_tokens=(FLAGS.chunk + 1) * FLAGS.num_probes,
        max_prefill_seqs=FLAGS.num_probes, enable_prefix_cache=False)
    engine = kvjax.Engine(model, config)
    if options.get("scaling") == "calibrated":
        text = make_text_tokens(model, FLAGS.calibration_tokens, FLAGS.seed + 7919)
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


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)  # [n, V]
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_stats(ref: np.ndarray, test: np.ndarray, targets: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Per-token KL(ref || test), top-1 agreement and the NLL of `targets` under both."""
    kl, agree, nll_ref, nll_test = [], [], [], []
    for start in range(0, ref.shape[0], 128):  # Bounds the float64 temporaries.
        lr = _log_softmax(ref[start:start + 128])  # [n, V]
        lt = _log_softmax(test[start:start + 128])
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


def capacity(model: kvjax.Model, codec: str) -> dict[str, float]:
    """Bytes per token and pages in a --budget_mib pool, vs float32 KV.

    KIVI windows (num_probes + 1 sequence slots) come out of the budget first, as in the engine.
    """
    page_size = FLAGS.page_size
    budget = FLAGS.budget_mib << 20
    exact = model.config.kv_bytes_per_token(np.float32)
    windows = 0
    if codec == "none":
        per_token = float(exact)
    else:
        name, options = codec.partition("-")[0], codec_options(codec, page_size, FLAGS.group)
        per_token = quantized.kv_bytes_per_token(model.config, name, **options)
        slots = quantized.num_seq_slots_for(name, FLAGS.num_probes, **options)
        windows = quantized.residual_bytes(model.config, slots, name, **options)
    pages = int((budget - windows) // (per_token * page_size))
    return dict(bytes_per_token=per_token, window_bytes=windows, pages=pages,
                capacity_x=pages / int(budget // (exact * page_size)))


COLUMNS = (("bytes_per_token", "bytes/token", "{:.0f}"), ("capacity_x", "pages x", "{:.2f}"),
           ("kl_mean", "KL mean", "{:.2e}"), ("kl_p99", "KL p99", "{:.2e}"),
           ("kl_max", "KL max", "{:.2e}"), ("top1_agreement", "top-1", "{:.3f}"),
           ("ppl_change_pct", "ppl change %", "{:+.2f}"),
           ("retrieval_pass", "retrieval", "{:.2f}"), ("decode_tok_s", "decode tok/s", "{:.1f}"),
           ("decode_tok_cpu_s", "decode tok/CPU-s", "{:.1f}"))


def main(argv):
    del argv
    t0 = time.perf_counter()
    model = kvjax.load_model()
    codecs = ["none", *FLAGS.codecs]
    contexts = [int(c) for c in FLAGS.contexts]
    probes = make_probes(model, FLAGS.num_probes, FLAGS.probe_words, FLAGS.seed,
                         FLAGS.needle_depth)
    print(f"probe prompts: {[len(p) for p, _ in probes]} tokens", flush=True)
    max_len = max(max(contexts), *(len(p) for p, _ in probes)) + FLAGS.max_new_tokens
    engines = {c: make_engine(model, c, max_len) for c in codecs}
    rows: dict[str, dict[str, float]] = {}
    for codec, engine in engines.items():
        probe = run_probes(engine, probes, FLAGS.max_new_tokens)
        print(f"{codec}: probes {probe} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for context in contexts:
            rows[f"{codec}, {context}"] = dict(**capacity(model, codec), **probe)
    quantized_engines = {c: e for c, e in engines.items() if c != "none"}
    for context in contexts:
        tokens = make_text_tokens(model, context, FLAGS.seed + context)
        scores = score_context(model, engines["none"], quantized_engines, tokens, str(context))
        for codec, stats in scores.items():
            rows[f"{codec}, {context}"].update(stats)
        ppl = next(iter(scores.values()))["ppl_exact"]
        rows[f"none, {context}"].update(kl_mean=0.0, kl_p99=0.0, kl_max=0.0,
                                        top1_agreement=1.0, ppl_change_pct=0.0, ppl_exact=ppl)
        print(f"context {context}: scored ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(format_rows(rows, COLUMNS, "codec, context"))
    print("\nexact perplexity: " + ", ".join(
        f"{c} tokens {rows[f'none, {c}']['ppl_exact']:.2f}" for c in contexts))
    print(f"total {time.perf_counter() - t0:.0f}s")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(dict(flags={k: FLAGS[k].value for k in (
                "codecs", "contexts", "page_size", "group", "chunk", "budget_mib", "num_probes",
                "probe_words", "needle_depth", "max_new_tokens", "seed",
                "calibration_tokens")}, rows=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
