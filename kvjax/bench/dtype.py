"""bfloat16 against float32 on the embedded model, side by side in one run.

Speed: the full-batch decode step at each batch size (engines of both dtypes take turns step
by step, `decode.timed_engine_runs`, so they see the same background load) and the prefill of
one prompt (the dtypes alternating, each prompt recomputed: no prefix cache), as tokens/s.
Quality: teacher-forced next-token distributions of the bfloat16 engine (bfloat16 weights,
activations and KV pages) against the float32 engine over fixed corpus text
(`quant.make_text_tokens`): KL(float32 || bfloat16) in nats per token (mean, p99, max) and
top-1 agreement. Once in prefill-sized steps (512 tokens) through XLA's matmuls, and once per
`decode_chunks` size through the native kernel (`matmul_impl` NATIVE: in bfloat16 its
AVX-512 BF16 path, as in decoding; 1 token per step is decoding's exact shape).

On a CPU without AMX (this one has AVX-512 BF16 but no AMX tiles), XLA's bfloat16 dots are
YNNPACK's or its own float32 dots over widened operands. Decode-sized steps take the native
matmul in both dtypes (`kvjax.models.linear`), in bfloat16 by AVX-512 BF16's pair products
(`vdpbf16ps`): bfloat16 halves the bytes of weights and pages, and doubles the products per
instruction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

import kvjax
from kvjax.bench import decode, quant
from kvjax.engine.step import MatmulImpl
from kvjax.models import linear

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DtypeBench:
    """What `run` measures.

    Attributes:
      batch_sizes: decode batch sizes (sequences decoding at once).
      prompt_len: prompt tokens of each decoding sequence.
      new_tokens: tokens each decoding sequence generates (timed).
      prefill_len: prompt tokens of the prefill measurement.
      prefill_repeats: timed prefills per dtype.
      quality_tokens: teacher-forced text tokens of the quality measurement.
      decode_chunks: tokens per step of the quality passes through the native matmul; empty:
        none.
      speed: whether to time decode and prefill (else quality only).
      page_size: tokens per KV page.
      seed: which corpus text the prompts are.
    """

    batch_sizes: Sequence[int] = (1, 16, 32)
    prompt_len: int = 64
    new_tokens: int = 64
    prefill_len: int = 512
    prefill_repeats: int = 3
    quality_tokens: int = 512
    decode_chunks: Sequence[int] = (1, 16)
    speed: bool = True
    page_size: int = 16
    seed: int = 0


def _engine(model: kvjax.Model, *, batch: int, max_len: int, chunk: int, page_size: int,
            matmul_impl: MatmulImpl = MatmulImpl.AUTO) -> kvjax.Engine:
    return kvjax.Engine(model, kvjax.EngineConfig(
        max_num_seqs=batch, max_model_len=max_len, page_size=page_size,
        max_num_batched_tokens=max(chunk, batch), max_prefill_chunk=chunk,
        enable_prefix_cache=False, matmul_impl=matmul_impl))


def decode_rates(models: dict[str, kvjax.Model], batch: int, settings: DtypeBench
                 ) -> dict[str, dict]:
    """{dtype: {tokens_per_s, step_ms}} of full-batch decode steps (median step)."""
    s = settings
    prompts = decode.make_prompts(models["float32"], batch, s.prompt_len, s.seed)
    engines = {name: _engine(m, batch=batch, max_len=s.prompt_len + s.new_tokens + 8,
                             chunk=512, page_size=s.page_size) for name, m in models.items()}
    for engine in engines.values():  # compiles the shapes the timed run takes
        engine.generate(prompts, kvjax.SamplingParams(max_new_tokens=8, ignore_eos=True))
    runs = decode.timed_engine_runs(engines, prompts, s.new_tokens, profile=False)
    out = {}
    for name, timed in runs.items():
        steps = [r.wall_s for r in timed.records
                 if r.num_decode == batch and r.num_prefill == 0 and not r.compiled]
        step = float(np.median(steps))
        out[name] = dict(tokens_per_s=batch / step, step_ms=1e3 * step, num_steps=len(steps))
    return out


def prefill_rates(models: dict[str, kvjax.Model], settings: DtypeBench) -> dict[str, dict]:
    """{dtype: {tokens_per_s, prefill_s}}: one prompt of prefill_len tokens (median)."""
    s = settings
    (prompt,) = decode.make_prompts(models["float32"], 1, s.prefill_len, s.seed + 1)
    engines = {name: _engine(m, batch=1, max_len=s.prefill_len + 8, chunk=s.prefill_len,
                             page_size=s.page_size) for name, m in models.items()}
    one = kvjax.SamplingParams(max_new_tokens=1, ignore_eos=True)
    for engine in engines.values():
        engine.generate([prompt], one)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(s.prefill_repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate([prompt], one)
            times[name].append(time.perf_counter() - start)
    return {name: dict(tokens_per_s=s.prefill_len / float(np.median(t)),
                       prefill_s=float(np.median(t))) for name, t in times.items()}


def quality(models: dict[str, kvjax.Model], settings: DtypeBench, chunk: int = 512,
            matmul_impl: MatmulImpl = MatmulImpl.XLA) -> dict[str, float]:
    """KL(float32 || bfloat16) per token (mean, p99, max) and top-1 agreement, teacher-forced
    over `quality_tokens` tokens of corpus text in steps of `chunk` tokens through
    `matmul_impl`, plus both perplexities and whether every step's matrix products were the
    native kernel's."""
    s = settings
    tokens = quant.make_text_tokens(models["float32"], s.quality_tokens, s.seed)
    engines = {name: _engine(m, batch=1, max_len=len(tokens) + 8, chunk=chunk,
                             page_size=s.page_size, matmul_impl=matmul_impl)
               for name, m in models.items()}
    refs = list(quant.teacher_forced_logits(engines["float32"], tokens, "quality"))
    tests = list(quant.teacher_forced_logits(engines["bfloat16"], tokens, "quality"))
    targets = np.asarray(tokens[1:], np.int64)
    ref, test = np.concatenate(refs), np.concatenate(tests)
    n = len(targets)  # the last row predicts no token
    stats = quant.token_stats(ref[:n], test[:n], targets)
    return dict(kl_mean=float(stats["kl"].mean()), kl_p99=float(np.percentile(stats["kl"], 99)),
                kl_max=float(stats["kl"].max()), top1_agreement=float(stats["agree"].mean()),
                ppl_float32=float(np.exp(stats["nll_ref"].mean())),
                ppl_bfloat16=float(np.exp(stats["nll_test"].mean())), num_tokens=n,
                chunk=chunk, native_matmul=matmul_impl is MatmulImpl.NATIVE
                and linear.unavailable_reason() is None)


def run(model_name: str | None, settings: DtypeBench) -> dict:
    """Every measurement, both dtypes of `model_name` (None: the embedded model)."""
    models = {name: kvjax.load_model(model_name, dtype=name) for name in DTYPES}
    result: dict = dict(environment=decode.environment(), settings=dataclasses.asdict(settings))
    if settings.speed:
        result["decode"] = {f"B={b}": decode_rates(models, b, settings)
                            for b in settings.batch_sizes}
        result["prefill"] = {f"prefill={settings.prefill_len}": prefill_rates(models, settings)}
    result["quality"] = quality(models, settings)
    result["quality_decode"] = {f"chunk={c}": quality(models, settings, c, MatmulImpl.NATIVE)
                                for c in settings.decode_chunks}
    return result


def format_table(result: dict) -> str:
    """A markdown table: tokens/s of each dtype and their ratio, then the quality row."""
    lines = []
    if "decode" in result:
        lines += ["| setting | float32 tok/s | bfloat16 tok/s | bf16 / f32 |",
                  "|---|---|---|---|"]
        for part in ("decode", "prefill"):
            for key, rates in result[part].items():
                f32, bf16 = rates["float32"]["tokens_per_s"], rates["bfloat16"]["tokens_per_s"]
                lines.append(f"| {key} | {f32:.1f} | {bf16:.1f} | {bf16 / f32:.2f} |")
        lines.append("")
    lines += ["| quality pass (tokens per step) | matmuls | tokens | KL mean | KL p99 | KL max | "
              "top-1 agreement | ppl float32 | ppl bfloat16 |", "|---" * 9 + "|"]
    for q in [result["quality"], *result.get("quality_decode", {}).values()]:
        lines.append(f"| {q['chunk']} | {'native' if q['native_matmul'] else 'XLA'} | "
                     f"{q['num_tokens']} | {q['kl_mean']:.2e} | {q['kl_p99']:.2e} | "
                     f"{q['kl_max']:.2e} | {q['top1_agreement']:.3f} | {q['ppl_float32']:.3f} "
                     f"| {q['ppl_bfloat16']:.3f} |")
    return "\n".join(lines)
