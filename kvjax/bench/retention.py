"""Retention policies at long context, memory, speed and quality vs exact KV: what
`scripts/bench_retention.py` runs; `run` is the whole benchmark.

For each policy and budget (`variants`, `name:budget` tokens, then any policy options as
`:option=value`, e.g. `quest:1024:dense_layers=0`) on needle-in-a-haystack prompts
(kvjax.bench.corpus.make_needle_prompt, one per `depths` entry, `context` tokens each):
  * KV bytes per sequence: the pages the sequence held, times the bytes of a page (all
    layers, K and V; Quest adds its per-page key summaries), at their peak (prefill included)
    and at their peak while decoding (what SnapKV saves shows only there), counted when each
    step is dispatched (its pages allocated, nothing evicted yet);
  * decode tokens/s: one sequence decoding at that context, 1 / the median step time over the
    steps that compiled nothing (the median resists load spikes on a shared machine);
  * quality, teacher-forced: the exact engine answers (the gold answer forced, then its own
    greedy continuation, `num_tokens` in all); each variant is forced through the same tokens,
    one decode step per token, and its next-token distributions are compared with exact's
    (KL(exact || variant) mean, p99 and worst over every token, top-1 agreement);
  * retrieval: a probe passes when the greedy prediction at every position of the gold answer
    is the answer's token (what free greedy decoding would then write);
  * for quest, the recall of the exact top-k attention pages: on exact K/V (a dense pass over
    the exact token sequence), at every continuation position and layer, the fraction of the k
    pages with the most attention mass (summed over heads) that Quest's bound selects
    (k = budget / page_size, the newest page always among Quest's). The row's recall averages
    the layers that select (the first dense_layers read every page); it is also reported per
    group of layers (`recall_groups`) and per layer in the JSON.

Teacher forcing goes through `Engine.force_token`, the per-dispatch page count through a step
observer.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.bench.corpus import make_needle_prompt
from kvjax.bench.metrics import quality_stats
from kvjax.engine.request import SeqStatus
from kvjax.engine.runner import StepObserver
from kvjax.engine.step import LogitsMode
from kvjax.kv import quest
from kvjax.kv.attention import paged_attention_blockwise, pages_loader
from kvjax.kv.retention import make_retention
from kvjax.models import llama


@dataclasses.dataclass(frozen=True)
class RetentionBench:
    """What one run of the retention benchmark compares, and on what.

    Attributes:
      variants: retention policies compared with exact KV, as `name[:budget][:option=value]`
        (`parse_variant`).
      depths: where the needle sits in each probe (fraction of the filler).
      context: prompt tokens per probe (the filler is sized to it).
      num_tokens: teacher-forced tokens per probe (answer included).
      page_size: tokens per page.
      chunk: prefill chunk.
      seed: probe seed.
      recall_groups: first layers of the layer groups Quest's page recall is reported for.
      exact_cache: an .npz file of the exact runs (`save_exact_runs`): read where it holds
        these probes' runs, else written once they ran, so that runs of other variants on the
        same probes skip exact KV; None: exact KV always runs.
      by_probe: run every variant on a probe before the next probe (each variant's engine
        kept warm from probe to probe), every row rewritten after each probe over the probes
        so far, so a run stopped early leaves rows on the same first probes; else one variant
        on every probe after another. Quest's page recall needs variant order.
    """

    variants: tuple[str, ...]
    depths: tuple[float, ...]
    context: int = 4096
    num_tokens: int = 24
    page_size: int = 16
    chunk: int = 512
    seed: int = 0
    recall_groups: tuple[int, ...] = (2, 10, 20)
    exact_cache: str | None = None
    by_probe: bool = False


def parse_variant(variant: str) -> tuple[str, int | None, dict]:
    """`name[:budget][:option=value...]` -> (policy, budget, options); values int, float,
    bool or str."""
    name, *rest = variant.split(":")
    budget = int(rest.pop(0)) if rest and "=" not in rest[0] else None
    options = {}
    for item in rest:
        key, _, value = item.partition("=")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[key] = lowered == "true"
            continue
        options[key] = value
        for kind in (float, int):  # the narrower last
            try:
                options[key] = kind(value)
            except ValueError:
                pass
    return name, budget, options


# A variant's options that are `EngineConfig` fields, not the policy's.
ENGINE_OPTIONS = {"schedule": "retention_schedule", "head_floor": "retention_head_floor"}


def split_options(options: dict) -> tuple[dict, dict]:
    """A variant's options -> (the policy's, `EngineConfig` fields: `ENGINE_OPTIONS`)."""
    return ({k: v for k, v in options.items() if k not in ENGINE_OPTIONS},
            {ENGINE_OPTIONS[k]: v for k, v in options.items() if k in ENGINE_OPTIONS})


def make_probe(model: kvjax.Model, context: int, depth: float, seed: int
               ) -> tuple[list[int], list[int]]:
    """A needle prompt of about `context` tokens and the tokens of its answer."""
    rng = np.random.default_rng(seed)
    key, value = "vault K", int(rng.integers(1000, 9999))
    tokenizer = model.tokenizer
    words = int(context / 1.3)
    for _ in range(8):  # Resize the filler until the prompt has about `context` tokens.
        text, answer = make_needle_prompt(np.random.default_rng(seed), words, key, value, depth)
        prompt = tokenizer.encode(text)
        if abs(len(prompt) - context) <= context // 50:
            break
        words = int(words * context / len(prompt))
    full = tokenizer.encode(text + " " + answer)
    if full[:len(prompt)] != prompt:
        raise ValueError("the answer does not tokenize as a continuation of the prompt")
    return prompt, full[len(prompt):]


def needle_position(prompt: list[int], answer: list[int]) -> int | None:
    """Index of the first prompt token of the planted fact's value (the answer's tokens as they
    first occur in the prompt), or None where the value tokenizes differently there."""
    n = len(answer)
    for i in range(len(prompt) - n + 1):
        if prompt[i:i + n] == answer:
            return i
    return None


def probes_payload(probes: list[tuple[list[int], list[int]]], exact_runs: list[dict],
                   settings: RetentionBench) -> list[dict]:
    """The probes as a peer framework replays them, one dict per probe.

    Each holds the prompt's token ids, the answer's, where the needle's value sits in the
    prompt (`needle_position`), the needle's depth and seed, and the `num_tokens` continuation
    ids every variant is forced through (the gold answer, then exact KV's greedy tokens).
    """
    return [dict(prompt=list(map(int, prompt)), answer=list(map(int, answer)),
                 needle_position=needle_position(prompt, answer),
                 depth=float(depth), seed=settings.seed + i,
                 continuation=list(map(int, run["tokens"])))
            for i, ((prompt, answer), run, depth) in enumerate(
                zip(probes, exact_runs, settings.depths, strict=True))]


def make_engine(model: kvjax.Model, variant: str, max_len: int, *, page_size: int, chunk: int,
                num_seqs: int = 1, async_scheduling: bool = True) -> kvjax.Engine:
    """`num_seqs` sequences at a time (one prefilling), prefill in `chunk` chunks, no prefix
    cache between probes (a pool the sequences fill is fine: with nothing else running,
    admission keeps no reserve).

    A variant's options `schedule` and `head_floor` are its `EngineConfig.retention_schedule`
    and `retention_head_floor` (e.g. 'snapkv:512:schedule=pyramid',
    'kvzip:512:schedule=global:head_floor=0'); a per-layer schedule gets a page per layer for every
    page of one table (AdaKV's head-wise split a page per layer and kv head), so every table
    group holds the whole prompt before it compacts. A press that probes after the prefill
    (kvzip) gets `chunk` more tokens of context and pages for its probe rows, and its steps
    pad to the longest probe row (rounded up to 128 tokens) rather than to `chunk`: a probe row
    of 2k tokens after an 8k prompt costs a 2k forward pass, not an 8k one."""
    name, budget, options = parse_variant(variant)
    options, fields = split_options(options)
    schedule = fields.setdefault("retention_schedule", "uniform")
    policy = make_retention(name, budget, page_size, **options)
    min_bucket = chunk
    if policy.probes_first:
        if policy.needs_tokenizer:
            policy = policy.bind_tokenizer(model.tokenizer)
        probes = policy.probes([0] * max_len, chunk)
        longest = max((len(p.token_ids) for p in probes), default=chunk)
        min_bucket = min(chunk, -(-longest // 128) * 128)
        max_len += chunk
    mc = model.config
    tables = dict(uniform=1, pyramid=mc.num_layers).get(schedule,
                                                       mc.num_layers * mc.num_kv_heads)
    config = kvjax.EngineConfig(
        page_size=page_size, num_pages=num_seqs * tables * (-(-max_len // page_size) + 1),
        max_model_len=max_len + page_size, max_num_seqs=num_seqs, max_prefill_seqs=1,
        max_prefill_chunk=chunk, min_chunk_bucket=min_bucket,
        max_num_batched_tokens=chunk, enable_prefix_cache=False,
        retention=name, retention_budget=budget, retention_options=options,
        async_scheduling=async_scheduling, **fields)
    return kvjax.Engine(model, config)


class _DispatchPages(StepObserver):
    """Records the pages in use at each dispatch.

    A step allocates its pages before it is dispatched and evicts after it ran, so this sees
    each step's peak, which sampling between steps would miss.
    """

    def __init__(self, engine: kvjax.Engine):
        self.engine = engine
        self.last = 0

    def before_step(self, shape, host_input) -> None:
        self.last = self.engine.allocator.num_used_pages()


def forced_run(engine: kvjax.Engine, prompt: list[int], forced: list[int], num_tokens: int,
               request_id: str) -> dict:
    """Decodes `num_tokens` tokens after `prompt`, forcing the first len(forced) of them.

    Returns the logits [num_tokens, V] each step sampled from, the tokens that went in (the
    forced ones, then the engine's greedy choices), the peak of pages the engine held (overall,
    probe rows included, and over decode steps) and the seconds of each decode step that
    compiled nothing.
    """
    engine.add_request(request_id, prompt, kvjax.SamplingParams(
        max_new_tokens=num_tokens, ignore_eos=True))
    logits, tokens, peak, decode_peak, decode_step_s = [], [], 0, 0, []
    seq_id = f"{request_id}#0"
    pages = _DispatchPages(engine)
    engine.add_step_observer(pages)
    seq = engine.sequence(seq_id)  # The live record: logits steps update it in place.
    try:
        while engine.has_unfinished():
            before, compiles = len(seq.tokens), engine.num_compiles
            # Probe rows (kvzip) run between the prefill and the first decode step.
            is_decode = seq.num_computed >= len(prompt) and seq.probing is None
            start = time.perf_counter()
            engine.step(logits_mode=LogitsMode.LAST)
            elapsed = time.perf_counter() - start
            peak = max(peak, pages.last)
            if is_decode:
                decode_peak = max(decode_peak, pages.last)
            if is_decode and engine.num_compiles == compiles:
                decode_step_s.append(elapsed)
            if len(seq.tokens) > before:
                logits.append(np.asarray(engine.last_logits[0], np.float64))
                i = len(seq.tokens) - 1 - len(prompt)
                if i < len(forced) and seq.status is not SeqStatus.FINISHED:
                    engine.force_token(seq_id, forced[i])
                tokens.append(forced[i] if i < len(forced) else seq.tokens[-1])
    finally:
        engine.remove_step_observer(pages)
    return dict(logits=np.stack(logits), tokens=tokens, peak_pages=peak,
                decode_peak_pages=decode_peak, decode_step_s=decode_step_s)


_EXACT_KEYS = ("logits", "tokens", "decode_step_s")


def save_exact_runs(path: str, probes: list[tuple[list[int], list[int]]], runs: list[dict],
                    num_tokens: int) -> None:
    """Writes the exact runs of `probes` (`forced_run`'s dicts) to the .npz file `path` (its
    folder made if missing: the runs took minutes)."""
    arrays = dict(num_tokens=np.asarray(num_tokens))
    for i, ((prompt, answer), run) in enumerate(zip(probes, runs, strict=True)):
        arrays[f"{i}_prompt"] = np.asarray(prompt, np.int64)
        arrays[f"{i}_answer"] = np.asarray(answer, np.int64)
        arrays[f"{i}_pages"] = np.asarray([run["peak_pages"], run["decode_peak_pages"]])
        for key in _EXACT_KEYS:
            arrays[f"{i}_{key}"] = np.asarray(run[key])
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_exact_runs(path: str, probes: list[tuple[list[int], list[int]]], num_tokens: int
                    ) -> list[dict] | None:
    """The exact runs `save_exact_runs` wrote to `path`, or None where the file is missing or
    holds other probes (prompt or answer tokens) or another number of forced tokens."""
    try:
        data = np.load(path)
    except FileNotFoundError:
        return None
    with data:
        if int(data["num_tokens"]) != num_tokens or any(
                f"{i}_prompt" not in data
                or data[f"{i}_prompt"].tolist() != list(prompt)
                or data[f"{i}_answer"].tolist() != list(answer)
                for i, (prompt, answer) in enumerate(probes)) or f"{len(probes)}_prompt" in data:
            return None
        runs = []
        for i in range(len(probes)):
            peak, decode_peak = data[f"{i}_pages"].tolist()
            runs.append(dict(logits=data[f"{i}_logits"], tokens=data[f"{i}_tokens"].tolist(),
                             decode_step_s=data[f"{i}_decode_step_s"].tolist(),
                             peak_pages=peak, decode_peak_pages=decode_peak))
    return runs


def exact_runs_of(model: kvjax.Model, probes: list[tuple[list[int], list[int]]],
                  max_len: int, settings: RetentionBench) -> tuple[list[dict], int]:
    """Exact KV's forced runs of `probes` (read from, or written to, settings.exact_cache) and
    the bytes of one of its pages."""
    exact = make_engine(model, "none", max_len, page_size=settings.page_size,
                        chunk=settings.chunk)
    page_bytes = int(exact.kv_spec.page_bytes)
    if settings.exact_cache is not None:
        runs = load_exact_runs(settings.exact_cache, probes, settings.num_tokens)
        if runs is not None:
            return runs, page_bytes
    runs = [forced_run(exact, prompt, answer, settings.num_tokens, f"exact-{i}")
            for i, (prompt, answer) in enumerate(probes)]
    if settings.exact_cache is not None:
        save_exact_runs(settings.exact_cache, probes, runs, settings.num_tokens)
    return runs, page_bytes


def capture_qk(model: kvjax.Model, tokens: list[int], num_last: int, page_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Exact queries of the last `num_last` tokens and keys of all, per layer.

    Returns (q [L, num_last, N, D], k [L, S, K, D]) float32, RoPE applied.
    """
    config = model.config
    block = page_size * 8
    length = -(-len(tokens) // block) * block
    ids = jnp.asarray(list(tokens) + [0] * (length - len(tokens)), jnp.int32)
    num_pages = length // page_size
    table = jnp.arange(num_pages, dtype=jnp.int32)[None]  # [1, W]
    last = len(tokens) - num_last

    def attend(layer, q, k, v, captured):
        qs, ks = captured
        pages = (k.reshape(num_pages, page_size, *k.shape[1:]),
                 v.reshape(num_pages, page_size, *v.shape[1:]))
        out = paged_attention_blockwise(q[None], pages_loader(*pages), table,
                                        jnp.array([length]), jnp.array([length]))  # [1, S, N, D]
        qs = qs.at[layer].set(jax.lax.dynamic_slice_in_dim(q, last, num_last).astype(qs.dtype))
        ks = ks.at[layer].set(k.astype(ks.dtype))
        return out[0], (qs, ks)

    init = (jnp.zeros((config.num_layers, num_last, config.num_heads, config.head_dim)),
            jnp.zeros((config.num_layers, length, config.num_kv_heads, config.head_dim)))
    run = jax.jit(lambda params: llama.decode_body(
        params, config, ids, jnp.arange(length, dtype=jnp.int32), attend, init)[1])
    qs, ks = run(model.params)
    return np.asarray(qs), np.asarray(ks[:, :len(tokens)])


def quest_layer_recall(q: np.ndarray, k: np.ndarray, page_size: int, num_read: int,
                       heads: quest.HeadReduction) -> np.ndarray:
    """Per layer, the mean fraction of the exact top-`num_read` attention pages Quest selects.

    q: [L, T, N, D] the last T queries (positions S - T .. S - 1); k: [L, S, K, D].
    Returns [L] (NaN where every query reads every page).
    """
    num_layers, t, n, d = q.shape
    s, k_heads = k.shape[1], k.shape[2]
    width = -(-s // page_size)
    padded = np.zeros((num_layers, width * page_size, k_heads, d), np.float32)
    padded[:, :s] = k
    pages = padded.reshape(num_layers, width, page_size, k_heads, d)
    recall = np.full(num_layers, np.nan)
    for layer in range(num_layers):
        hits, total = 0, 0
        for i in range(t):
            pos = s - t + i
            own = pos // page_size
            if own + 1 <= num_read:
                continue  # every page is read: nothing to select
            keys = pages[layer, :own + 1]  # [own+1, P, K, D]; the own page is always chosen
            bounds = quest.page_bounds(jnp.asarray(q[layer, i][None]),
                                       jnp.asarray(keys.min(axis=1)[None]),
                                       jnp.asarray(keys.max(axis=1)[None]))  # [1, W', N]
            reduce = jnp.max if heads is quest.HeadReduction.MAX else jnp.sum
            chosen, _ = quest.select_pages(reduce(bounds, axis=-1), jnp.array([pos + 1]),
                                           page_size, num_read)
            g = n // k_heads
            kk = np.repeat(k[layer, :pos + 1], g, axis=1)  # [pos+1, N, D]
            logits = np.einsum("nd,snd->ns", q[layer, i], kk) / np.sqrt(d)  # [N, pos+1]
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            mass = np.bincount(np.arange(pos + 1) // page_size, weights=probs.sum(axis=0))
            best = set(np.argsort(-mass, kind="stable")[:num_read].tolist())
            hits += len(best & set(np.asarray(chosen[0]).tolist()))
            total += num_read
        if total:
            recall[layer] = hits / total
    return recall


def recall_by_group(recall: np.ndarray, dense_layers: int, starts: list[int]
                    ) -> dict[str, float]:
    """Mean recall [L] per layer group `start-end` (inclusive), the dense layers left out."""
    bounds = sorted({0, *starts, len(recall)})
    groups = {}
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        lo = max(lo, dense_layers)
        if lo < hi:
            groups[f"{lo}-{hi - 1}"] = float(np.mean(recall[lo:hi]))
    return groups


COLUMNS = (("kv_mib_per_seq", "KV MiB/seq peak", "{:.1f}"),
           ("decode_kv_mib_per_seq", "KV MiB/seq decoding", "{:.1f}"),
           ("decode_kv_fraction", "decoding KV vs exact", "{:.2f}"),
           ("decode_tok_s", "decode tok/s", "{:.1f}"), ("kl_mean", "KL mean", "{:.3f}"),
           ("kl_p99", "KL p99", "{:.3f}"), ("kl_max", "KL worst", "{:.3f}"),
           ("top1_agreement", "top-1", "{:.3f}"), ("retrieval_pass", "retrieval", "{:.2f}"),
           ("quest_page_recall", "page recall", "{:.3f}"))


def kv_bytes(engine: kvjax.Engine, peak_pages: int) -> int:
    """Bytes of the pages a sequence held at its peak, Quest's page summaries included."""
    return int(peak_pages * engine.kv_spec.page_bytes)


class VariantRuns:
    """A variant's engine, kept warm from probe to probe, and its forced runs so far."""

    def __init__(self, model: kvjax.Model, variant: str, max_len: int,
                 settings: RetentionBench):
        self.variant = variant
        self.settings = settings
        self.engine = make_engine(model, variant, max_len, page_size=settings.page_size,
                                  chunk=settings.chunk)
        self.refs, self.tests, self.passed = [], [], []
        self.peaks, self.decode_peaks, self.decode_step_s = [], [], []

    def add(self, prompt: list[int], answer: list[int], exact: dict) -> None:
        """Forces the variant through one probe's exact run."""
        run = forced_run(self.engine, prompt, exact["tokens"], self.settings.num_tokens,
                         f"{self.variant}-{len(self.refs)}")
        self.refs.append(exact["logits"])
        self.tests.append(run["logits"])
        self.passed.append(bool(np.all(run["logits"][:len(answer)].argmax(-1) == answer)))
        self.peaks.append(run["peak_pages"])
        self.decode_peaks.append(run["decode_peak_pages"])
        self.decode_step_s += run["decode_step_s"]

    def row(self) -> dict[str, float]:
        """The row over the probes run so far, vs exact."""
        return dict(quality_stats(np.concatenate(self.refs), np.concatenate(self.tests)),
                    retrieval_pass=float(np.mean(self.passed)),
                    kv_mib_per_seq=kv_bytes(self.engine, max(self.peaks)) / 2**20,
                    decode_kv_mib_per_seq=kv_bytes(self.engine, max(self.decode_peaks)) / 2**20,
                    decode_tok_s=1.0 / float(np.median(self.decode_step_s)),
                    retention_stats=dict(self.engine.retention.stats))


def run_variant(model: kvjax.Model, variant: str, probes: list[tuple[list[int], list[int]]],
                exact_runs: list[dict], max_len: int, settings: RetentionBench
                ) -> dict[str, float]:
    """The row of one variant: its forced runs through the exact runs' tokens, vs exact."""
    runs = VariantRuns(model, variant, max_len, settings)
    for (prompt, answer), exact in zip(probes, exact_runs, strict=True):
        runs.add(prompt, answer, exact)
    return runs.row()


def quest_recall(variant: str, captured: list[tuple[np.ndarray, np.ndarray]],
                 settings: RetentionBench, cache: dict) -> dict:
    """A quest variant's page recall: mean over the selecting layers, per group, per layer.

    `cache` keeps the per-layer recall of each (pages read, head reduction), which does not
    depend on dense_layers.
    """
    _, budget, options = parse_variant(variant)
    policy = make_retention("quest", budget, settings.page_size, **options)
    key = (policy.num_read_pages, policy.heads)
    if key not in cache:
        cache[key] = np.mean([quest_layer_recall(q, k, settings.page_size, *key)
                              for q, k in captured], axis=0)  # [L]
    recall, dense = cache[key], policy.dense_layers
    return dict(quest_page_recall=float(np.mean(recall[dense:])),
                quest_page_recall_by_layers=recall_by_group(recall, dense,
                                                            list(settings.recall_groups)),
                quest_page_recall_per_layer=recall.tolist())


def exact_row(exact_runs: list[dict], probes: list[tuple[list[int], list[int]]],
              page_bytes: int) -> dict:
    """Exact KV's row ("none") over `probes` and their exact runs."""
    peak = max(r["peak_pages"] for r in exact_runs)
    decode_peak = max(r["decode_peak_pages"] for r in exact_runs)
    return dict(
        kv_mib_per_seq=peak * page_bytes / 2**20,
        decode_kv_mib_per_seq=decode_peak * page_bytes / 2**20, decode_kv_fraction=1.0,
        decode_tok_s=1.0 / float(np.median(sum((r["decode_step_s"] for r in exact_runs), []))),
        kl_mean=0.0, kl_p99=0.0, kl_max=0.0, top1_agreement=1.0,
        retrieval_pass=float(np.mean([np.all(r["logits"][:len(a)].argmax(-1) == a)
                                      for r, (_, a) in zip(exact_runs, probes, strict=True)])))


def run(model: kvjax.Model, settings: RetentionBench,
        on_row: Callable[[dict], None] | None = None) -> dict:
    """Exact KV ("none") and every variant on the needle probes, printing each row.

    Returns dict(rows={variant: row}, prompt_tokens=[tokens of each probe prompt],
    probes=`probes_payload`); `on_row`, if given, receives that dict after every row (the rows
    so far), so a long run's finished rows can be saved as they come.
    """
    t0 = time.perf_counter()
    probes = [make_probe(model, settings.context, depth, settings.seed + i)
              for i, depth in enumerate(settings.depths)]
    max_len = max(len(p) for p, _ in probes) + settings.num_tokens
    if settings.by_probe and any(parse_variant(v)[0] == "quest" for v in settings.variants):
        raise ValueError("by_probe: quest's page recall captures every probe first; run quest "
                         "variants with by_probe=False")
    exact_runs, page_bytes = exact_runs_of(model, probes, max_len, settings)
    rows = {"none": exact_row(exact_runs, probes, page_bytes)}
    print(f"exact: {rows['none']} ({time.perf_counter() - t0:.0f}s)", flush=True)
    report = dict(rows=rows, prompt_tokens=[len(p) for p, _ in probes],
                  probes=probes_payload(probes, exact_runs, settings))
    if on_row is not None:
        on_row(report)
    if settings.by_probe:
        runs = {v: VariantRuns(model, v, max_len, settings) for v in settings.variants}
        for i, ((prompt, answer), exact) in enumerate(zip(probes, exact_runs, strict=True)):
            rows["none"] = exact_row(exact_runs[:i + 1], probes[:i + 1], page_bytes)
            for variant, variant_runs in runs.items():
                variant_runs.add(prompt, answer, exact)
                row = variant_runs.row()
                rows[variant] = dict(row, decode_kv_fraction=(
                    row["decode_kv_mib_per_seq"] / rows["none"]["decode_kv_mib_per_seq"]))
                print(f"probe {i} {variant}: kl_mean {rows[variant]['kl_mean']:.3f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
            report["prompt_tokens"] = [len(p) for p, _ in probes[:i + 1]]
            if on_row is not None:
                on_row(report)
        return report
    captured, layer_recall = None, {}
    for variant in settings.variants:
        row = run_variant(model, variant, probes, exact_runs, max_len, settings)
        row["decode_kv_fraction"] = (row["decode_kv_mib_per_seq"]
                                     / rows["none"]["decode_kv_mib_per_seq"])
        if parse_variant(variant)[0] == "quest":
            if captured is None:
                captured = [capture_qk(model, prompt + r["tokens"], settings.num_tokens,
                                       settings.page_size)
                            for (prompt, _), r in zip(probes, exact_runs, strict=True)]
            row.update(quest_recall(variant, captured, settings, layer_recall))
        rows[variant] = row
        print(f"{variant}: {row} ({time.perf_counter() - t0:.0f}s)", flush=True)
        if on_row is not None:
            on_row(report)
    return report
