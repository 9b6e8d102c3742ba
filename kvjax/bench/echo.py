"""Host-authoritative sparse KV (ECHO) on needle probes: prefetch recall and bytes moved per
decode step, and the link time of those bytes on a simulated clock (`scripts/bench_echo.py`).

For each probe (`kvjax.bench.retention.make_probe`: a needle prompt of `context` tokens) the
plain Quest engine decodes `num_tokens` greedy tokens; then an ECHO engine per prefetch margin
m (`retention_options echo_prefetch=m`, `kvjax.engine.echo`) decodes the same prompt. Every run
records each decode step's exact selection (`StepOutput.page_reads`, every layer); ECHO's must
equal plain Quest's at every step, and its tokens too (`selection_equal`, `tokens_equal`).

Per ECHO run, means per decode step:
  * recall: of the (layer, page) reads of full pages, the share whose page was already on the
    device (the newest, partial page is always there and is not counted);
  * device pages per sequence: Quest's budget plus m plus the page being written (after the
    first decode step; each layer keeps its own Quest budget plus m pages in them, per-(layer,
    page) residency, `kvjax.scheduler.echo`), against all of the sequence's pages for plain
    Quest;
  * released: per layer, the sequence's pages that layer reads from the host pool (mean over
    layers and steps);
  * bytes host -> device: misses (one layer of one page per miss, K and V) and prefetched
    layers of pages (one layer of one page each); the key summaries of every page stay in
    device memory (the host pool's summary leaves live there: `summary_bytes_per_page` beside
    `kv_bytes_per_page`),
    so the selection reads nothing over the link; bytes device -> host: pages copied to the host
    pool as they fill during decoding (the prompt's pages, copied once at the first decode
    step, are reported apart: `mirror_bytes_once`);
  * refetched: of the prefetched layers of pages, those the step the plan came from had just
    read from the host pool as misses (they cross the link twice);
  * kept: misses the step wrote into frames (`echo_keep_misses`, compared on and off with
    `keep_misses`): they cross the link once, read by the step, and the copy into the frame
    is a device write, counted in no link direction;
  * on demand: the bytes if the device kept no page but the one being written and fetched
    every selected full page's layer each step (plain Quest's reads, no residency);
  * link ms (simulated): those bytes over each link of `kvjax.bench.host_attention.LINKS`
    (per direction; the device -> host copy runs on the other direction, so the step waits
    for the larger of the two), on a simulated clock: the bytes are counted here, the time is
    the link model's, not a measurement (on this CPU host and device are one memory).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import kvjax
from kvjax.bench import host_attention
from kvjax.bench.retention import make_probe
from kvjax.engine.runner import StepObserver


@dataclasses.dataclass(frozen=True)
class EchoBench:
    """Attributes:
      context: prompt tokens per probe; depths: the needle's depth in each probe.
      num_tokens: greedy tokens decoded per probe.
      budget: Quest's read budget in tokens (budget / page_size pages per query).
      dense_layers: Quest's dense layers (they read every page).
      prefetch: the ECHO prefetch margins m compared.
      keep_misses: Quest's `echo_keep_misses` settings compared (each margin runs each).
      async_scheduling: the engines' `EngineConfig.async_scheduling`.
      page_size, chunk: pages and prefill chunk; seed: probe seed.
    """

    context: int = 2048
    depths: tuple[float, ...] = (0.25, 0.75)
    num_tokens: int = 32
    budget: int = 256
    dense_layers: int = 0
    prefetch: tuple[int, ...] = (0, 4, 16)
    keep_misses: tuple[bool, ...] = (True,)
    async_scheduling: bool = True
    page_size: int = 16
    chunk: int = 512
    seed: int = 0


class _Reads(StepObserver):
    """Each decode step's selection [L, W] of the one sequence, and how many of its table
    entries each layer reads from the host pool (mean over layers)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.steps: list[np.ndarray] = []
        self.released: list[int] = []

    def after_step(self, shape, host_input, out) -> None:
        if out.page_reads is None:
            return
        self.steps.append(np.asarray(out.page_reads)[0])
        tables = host_input["layer_tables"]  # [Bd, L, W]; [0, ...] without ECHO
        num_pages = -(-int(host_input["kv_lens"][0]) // self.page_size)
        self.released.append(float((tables[0, :, :num_pages] < 0).sum(axis=1).mean())
                             if tables.size else 0.0)


def _engine(model, settings: EchoBench, max_len: int, prefetch: int | None,
            keep: bool = True) -> kvjax.Engine:
    options = dict(dense_layers=settings.dense_layers)
    if prefetch is not None:
        options.update(echo_prefetch=prefetch, echo_keep_misses=keep)
    else:
        options["record_reads"] = True  # the oracle's selection, step by step
    p = settings.page_size
    config = kvjax.EngineConfig(
        page_size=p, num_pages=-(-max_len // p) + 2, max_model_len=max_len + p,
        max_num_seqs=1, max_prefill_seqs=1, max_prefill_chunk=settings.chunk,
        min_chunk_bucket=settings.chunk, max_num_batched_tokens=settings.chunk,
        enable_prefix_cache=False, retention="quest", retention_budget=settings.budget,
        retention_options=options, attention_impl="reference",
        async_scheduling=settings.async_scheduling,
        num_host_pages=-(-max_len // p) + 2 if prefetch is not None else 0)
    return kvjax.Engine(model, config)


def _decode(engine: kvjax.Engine, prompt: list[int], num_tokens: int) -> dict:
    reads = _Reads(engine.config.page_size)
    engine.runner.observers.append(reads)
    out = engine.generate([prompt], kvjax.SamplingParams(max_new_tokens=num_tokens,
                                                         ignore_eos=True))[0]
    keys = ("echo_selected_pages", "echo_resident_reads", "echo_pages_mirrored",
            "echo_layer_pages_prefetched", "echo_pages_released", "echo_frames_taken",
            "echo_refetched_layer_pages", "echo_misses_kept")
    return dict(tokens=list(out.outputs[0].token_ids), reads=reads.steps,
                released=reads.released, stats={k: engine.stats.get(k, 0) for k in keys})


def _page_bytes(engine: kvjax.Engine, model) -> tuple[float, float]:
    """(K and V bytes of one layer of one page, key-summary bytes of one layer of a page)."""
    c = model.config
    p = engine.config.page_size
    layer_kv = engine.kv_bytes_per_token * p / c.num_layers
    summary = 2 * c.num_kv_heads * c.head_dim * 4  # key_min, key_max float32
    return layer_kv, summary


def _full_page_reads(reads: list[np.ndarray], prompt_len: int, page_size: int) -> int:
    """(layer, page) reads of full pages over the decode steps (step i writes token
    prompt_len + i, whose page is not full)."""
    return sum(int(r[:, :(prompt_len + i) // page_size].sum()) for i, r in enumerate(reads))


def echo_row(run: dict, plain: dict, engine, model, settings: EchoBench, prefetch: int,
             prompt_len: int) -> dict:
    """One ECHO run's means per decode step against the plain Quest run of the same probe."""
    c = model.config
    p = settings.page_size
    layer_kv, summary = _page_bytes(engine, model)
    s = run["stats"]
    steps = max(len(run["reads"]), 1)
    misses = s["echo_selected_pages"] - s["echo_resident_reads"]
    kept = settings.budget // p - 1 + prefetch
    mirrored_once = prompt_len // p  # the prompt's full pages, copied at the first decode step
    parts = dict(miss=misses * layer_kv,
                 prefetch=s["echo_layer_pages_prefetched"] * layer_kv)
    h2d = sum(parts.values()) / steps
    d2h = (s["echo_pages_mirrored"] - mirrored_once) * c.num_layers * layer_kv / steps
    row = dict(
        prefetch=prefetch, decode_steps=len(run["reads"]),
        selection_equal=len(run["reads"]) == len(plain["reads"]) and all(
            np.array_equal(a, b) for a, b in zip(run["reads"], plain["reads"], strict=True)),
        tokens_equal=run["tokens"] == plain["tokens"],
        recall=s["echo_resident_reads"] / max(s["echo_selected_pages"], 1),
        device_pages=kept + 2, all_pages=-(-(prompt_len + settings.num_tokens) // p),
        released_per_step=sum(run["released"]) / steps,
        misses_per_step=misses / steps,
        prefetched_per_step=s["echo_layer_pages_prefetched"] / steps,
        refetched_per_step=s["echo_refetched_layer_pages"] / steps,
        kept_per_step=s["echo_misses_kept"] / steps,
        **{f"h2d_{k}_bytes_per_step": v / steps for k, v in parts.items()},
        h2d_bytes_per_step=h2d, d2h_bytes_per_step=d2h,
        mirror_bytes_once=mirrored_once * c.num_layers * layer_kv,
        summary_bytes_per_page=c.num_layers * summary, kv_bytes_per_page=c.num_layers * layer_kv,
        on_demand_bytes_per_step=_full_page_reads(plain["reads"], prompt_len, p) * layer_kv
        / steps)
    for link, bandwidth in host_attention.LINKS.items():
        row[f"link_ms_{link}"] = 1e3 * max(h2d, d2h) / bandwidth
        row[f"on_demand_link_ms_{link}"] = 1e3 * row["on_demand_bytes_per_step"] / bandwidth
    return row


def run(model, settings: EchoBench, on_row=None) -> dict:
    """Every probe: plain Quest, then ECHO per prefetch margin (and per `keep_misses` setting
    where it compares several); rows keyed 'depth m' ('depth m keep')."""
    rows = {}
    max_len = settings.context + settings.context // 10 + settings.num_tokens
    for i, depth in enumerate(settings.depths):
        prompt, _ = make_probe(model, settings.context, depth, settings.seed + i)
        plain = _decode(_engine(model, settings, max_len, None), prompt, settings.num_tokens)
        for m in settings.prefetch:
            for keep in settings.keep_misses:
                engine = _engine(model, settings, max_len, m, keep)
                row = echo_row(_decode(engine, prompt, settings.num_tokens), plain, engine,
                               model, settings, m, len(prompt))
                row.update(depth=depth, prompt_tokens=len(prompt), keep_misses=keep)
                name = f"depth={depth} m={m}" + (
                    f" keep={keep}" if len(settings.keep_misses) > 1 else "")
                rows[name] = row
                if on_row is not None:
                    on_row(name, row)
    return dict(settings=dataclasses.asdict(settings), links=host_attention.LINKS, rows=rows)
