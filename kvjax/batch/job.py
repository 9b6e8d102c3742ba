"""An offline batch job: JSONL requests in, one JSONL output line per id, crash-safe.

    stats = run_batch(model, "in.jsonl", "out.jsonl", order="prefix")

Requests are parsed (a bad line becomes an error line, alone), arranged by an `Ordering`,
and fed to one `Engine` a window at a time, so the run order reaches the prefix cache.
Requests with `score` or `next_top_k` run prefill-only (`PrefillOnlyScorer`), not through
the engine.
Every finished id is appended durably (`OutputLog`); a re-run skips ids already done, so a
killed job re-run with the same command ends with each id exactly once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from kvjax.batch.ordering import make_ordering
from kvjax.batch.output import OutputLog
from kvjax.batch.requests import BadLine, BatchRequest, line_id, parse_line
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.request import RequestOutput
from kvjax.generation import encode_prompt
from kvjax.models.model import Model
from kvjax.models.scoring import PrefillOnlyScorer


@dataclasses.dataclass
class BatchStats:
    """What a run did (this run only: ids done by an earlier run are not counted).

    Attributes:
      num_done, num_errors, num_skipped: ids written, of them errors, ids already done.
      seconds: wall time from the first request to the last line.
      prefill_tokens: tokens prefilled (prefix-cache hits excluded, recomputation included).
      prompt_tokens: prompt tokens of the generation requests written.
      prefix_hit_tokens: of them, tokens served from the prefix cache.
      generated_tokens: tokens decoded.
    """

    num_done: int = 0
    num_errors: int = 0
    num_skipped: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prompt_tokens, 1)


def pending_lines(path: str, skip: set[str]) -> Iterator[tuple[str, int] | BadLine]:
    """The input's lines not yet done, as (line, line number) in file order; a repeat of an
    earlier line's id becomes a `BadLine` (reported under `<id>@line:<n>`, so a re-run skips the
    report too). Ids in `skip` are left out."""
    seen: set[str] = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rid = line_id(line, n)
            if rid in seen:
                if f"{rid}@line:{n}" not in skip:
                    yield BadLine(f"{rid}@line:{n}", "id", f"repeats id {rid!r} of an earlier "
                                  f"line")
                continue
            seen.add(rid)
            if rid not in skip:
                yield line, n


def parse_request(model: Model, line: str, line_number: int) -> BatchRequest | BadLine:
    """One input line parsed with `model`'s tokenizer, or the `BadLine` it raised."""
    tokenizer = model.tokenizer

    def chat(messages):
        if tokenizer is None:
            raise ValueError("chat messages need a model with a tokenizer")
        return tokenizer.encode(tokenizer.apply_chat_template(messages))

    try:
        return parse_line(line, line_number, lambda t: encode_prompt(model, t), chat)
    except BadLine as e:
        return e


def read_requests(model: Model, path: str, skip: set[str]
                  ) -> Iterator[BatchRequest | BadLine]:
    """The input's requests in file order, a `BadLine` in place of each bad one; ids in
    `skip` (already done) and repeats of an id are left out or reported."""
    for item in pending_lines(path, skip):
        yield item if isinstance(item, BadLine) else parse_request(model, *item)


def output_record(out: RequestOutput) -> dict:
    """The output line of a finished generation request."""
    if out.error:
        return {"id": out.request_id, "error": out.error}
    sample = out.outputs[0]
    return {"id": out.request_id, "tokens": sample.token_ids, "text": sample.text,
            "logprobs": sample.logprobs, "finish_reason": sample.finish_reason.value,
            "num_prompt_tokens": len(out.prompt_ids),
            "num_cached_prompt_tokens": out.num_cached_prompt_tokens}


def score_record(scorer: PrefillOnlyScorer, request: BatchRequest) -> dict:
    """The output line of a prefill-only request: the `next_top_k` most likely next tokens
    as [token, logprob] pairs, or each continuation's summed and per-token log-probabilities
    given the prompt."""
    if request.next_top_k is not None:
        top = scorer.top_next(request.request_id, request.prompt_ids, request.next_top_k)
        return {"id": request.request_id, "top_logprobs": [list(p) for p in top]}
    scores = []
    for continuation in request.continuations:
        token_logprobs = scorer.score(request.request_id, request.prompt_ids, continuation)
        scores.append({"logprob": sum(token_logprobs), "token_logprobs": token_logprobs})
    return {"id": request.request_id, "scores": scores}


class ProgressBar:
    """A tqdm bar over ids (throughput and ETA from tqdm), or nothing when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm import tqdm  # Imported lazily: only the interactive script shows a bar.

            self._bar = tqdm(total=total, initial=initial, unit="req", smoothing=0.1)

    def update(self, tokens: int) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(gen_tokens=tokens, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class BatchRunner:
    """One engine and one prefill-only scorer that run lists of parsed requests: what the
    single-process job holds, and what each Ray Data actor holds (`kvjax.batch.ray_job`).

    Attributes:
      model: the model served.
      engine: the engine generation requests run on.
    """

    def __init__(self, model: Model, *, order: str = "input",
                 engine_config: EngineConfig | None = None, window: int | None = None,
                 score_kv_budget_bytes: int | None = None):
        self.model = model
        self._ordering = make_ordering(order)
        self.engine = Engine(model, engine_config)
        self._window = window or 2 * self.engine.config.max_num_seqs
        self._scorer = PrefillOnlyScorer(model, kv_budget_bytes=score_kv_budget_bytes
                                         or self.engine.num_pages * self.engine.kv_bytes_per_page)

    def run(self, items: list[BatchRequest | BadLine], write: Callable[[dict], None]) -> None:
        """Writes one output record per item: bad lines first, then the requests in the
        ordering's order, each as it finishes."""
        good = self._ordering.arrange([i for i in items if not isinstance(i, BadLine)],
                                      lambda t: encode_prompt(self.model, t))
        for e in items:
            if isinstance(e, BadLine):
                write({"id": e.request_id, "error": str(e), "field": e.field})
        _feed(self.engine, self._scorer, good, self._window, write)


class StatsWriter:
    """Appends records to an `OutputLog` and counts them into `stats` (and a progress bar)."""

    def __init__(self, log: OutputLog, stats: BatchStats, bar: ProgressBar):
        self._log, self._stats, self._bar = log, stats, bar

    def __call__(self, record: dict) -> None:
        stats = self._stats
        self._log.write(record)
        stats.num_done += 1
        stats.num_errors += "error" in record
        stats.generated_tokens += len(record.get("tokens", ()))
        stats.prompt_tokens += record.get("num_prompt_tokens", 0)
        stats.prefix_hit_tokens += record.get("num_cached_prompt_tokens", 0)
        self._bar.update(stats.generated_tokens)


def run_batch(model: Model, input_path: str, output_path: str, *, order: str = "input",
              engine_config: EngineConfig | None = None, window: int | None = None,
              score_kv_budget_bytes: int | None = None, progress: bool = False
              ) -> BatchStats:
    """Runs every id of `input_path` not yet in `output_path`; returns what this run did.

    Args:
      order: a registered `Ordering` name ('input', 'prefix', 'fields', 'blend').
      engine_config: the engine's config (its prefix cache turns ordering into hits).
      window: requests queued in the engine at once (default 2 * max_num_seqs): small
        enough that the run order decides what shares the prefix cache.
      score_kv_budget_bytes: KV bytes prefill-only scoring may hold (default: the engine's).
      progress: show a tqdm bar.
    """
    runner = BatchRunner(model, order=order, engine_config=engine_config, window=window,
                         score_kv_budget_bytes=score_kv_budget_bytes)
    with OutputLog(output_path) as log:
        items = list(read_requests(model, input_path, log.done))
        stats = BatchStats(num_skipped=len(log.done))
        bar = ProgressBar(len(items) + len(log.done), len(log.done), progress)
        t0 = time.perf_counter()
        runner.run(items, StatsWriter(log, stats, bar))
        stats.seconds = time.perf_counter() - t0
        bar.close()
    stats.prefill_tokens = runner.engine.metrics()["prefill_tokens"]
    return stats


def _feed(engine: Engine, scorer: PrefillOnlyScorer, requests: list[BatchRequest],
          window: int, write) -> None:
    """Keeps up to `window` requests in the engine, in `requests` order, writing each line
    as its request finishes; scoring requests run prefill-only as their turn comes.

    Pages enter the prefix cache only once computed, so a request whose first page matches
    that of a request still in prefill waits (and the ones behind it, keeping the order):
    admitted together, both would compute the shared prefix.
    """
    page = engine.config.page_size
    in_prefill: dict[tuple[int, ...], str] = {}  # first page -> the request computing it
    queue, in_flight = list(reversed(requests)), 0
    while queue or in_flight:
        while queue and in_flight < window:
            key = tuple(queue[-1].prompt_ids[:page])
            if key in in_prefill:
                break
            request = queue.pop()
            if _submit(engine, scorer, request, write):
                in_flight += 1
                in_prefill[key] = request.request_id
        for out in engine.step() if in_flight else ():
            write(output_record(out))
            in_flight -= 1
        if in_prefill:
            prefilling = {o.request_id for o in engine.snapshot_outputs(drain=False,
                                                                        with_text=False)
                          if not o.outputs[0].token_ids}
            in_prefill = {k: r for k, r in in_prefill.items() if r in prefilling}


def _submit(engine: Engine, scorer: PrefillOnlyScorer, request: BatchRequest, write) -> int:
    """Queues a generation request (1) or writes a scoring request's or a rejected request's
    line now (0)."""
    try:
        if request.is_prefill_only:
            write(score_record(scorer, request))
            return 0
        engine.add_request(request.request_id, request.prompt_ids, request.sampling)
        return 1
    except ValueError as e:
        field = ("prompt" if not request.is_prefill_only else
                 "score" if request.continuations is not None else "next_top_k")
        write({"id": request.request_id, "error": str(e), "field": field})
        return 0
