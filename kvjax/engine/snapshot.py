"""Engine snapshots: save in-flight requests with their KV, restore them into another engine.

`save_snapshot(engine, directory)` writes, between steps, for the chosen unfinished requests
(all by default), with orbax:

  * kv: the KV pages their running sequences have computed, gathered from the pool, one array
    per leaf of the KV pytree viewed page-major, `[L, num_saved_pages, ...]` (for the exact
    pool `[L, num_saved_pages, P, K, D]` keys and values; codes and scales for a quantized
    pool; Quest's page summaries). A page shared by several sequences (the prompt of an n > 1
    group) is saved once. A sequence retention compacted saves the pages it holds (where
    block tables keep budgets of their own, each table's at its own cached length).
  * windows: a KIVI pool's per-sequence exact windows (the state's sequence-slot leaves), one
    per saved sequence, `[L, num_saved_windows, ...]` per leaf.
  * meta (JSON): every sequence record (tokens, num_computed, sampling params, seed, status,
    timings, weights version, ...), each sequence's saved page indices, window index, KV floor
    (`WindowFloors.floor`) and retention record (which tokens its pages hold, their
    scores; one per block table that keeps a budget of its own), the request records
    (prompt, n, arrival, tenant), and the provenance: readable parts and each sequence's
    fingerprint.

`restore_snapshot(engine, directory)` checks the provenance against the target engine (same
model, weights version, tokenizer, codec, KV dtype, layout and page size, else a ValueError
naming the mismatch), then allocates pages, scatters the saved KV into them and queues the
sequences as they were: running ones continue decoding where they stopped, and greedy or
seeded sampling continues with the same tokens.

What is not carried over: the prefix cache's index of pages no saved sequence holds (the
target's own index is kept, and restored full pages are indexed as they are committed), KV
of swapped-out sequences and of sequences loading from tiers (restored as waiting, so their
tokens are recomputed), scheduler policy counters and engine stats. Clock readings (arrival,
token times) are rebased onto the target engine's clock, keeping their age at the save.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Sequence as Seq
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax.engine import compat
from kvjax.engine.engine import Engine
from kvjax.engine.request import FinishReason, SeqStatus, Sequence
from kvjax.grammar import Grammar, GrammarKind
from kvjax.kv import pages as kv_pages
from kvjax.kv.state import pages_for
from kvjax.memory.block_manager import RELEASED
from kvjax.sampling import SamplingParams
from kvjax.scheduler.controller import SLO

SNAPSHOT_FORMAT = 1


# ----------------------------------------------------------------------------- KV pages


def _check_pages_hold_all_kv(engine: Engine) -> None:
    """Raises ValueError when part of a sequence's KV lives outside its pages (retention, KIVI
    windows: the reasons come from kvjax.engine.compat)."""
    compat.check(engine.config, on_mesh=engine.mesh is not None,
                 uses=(compat.Feature.SNAPSHOT, *compat.operations_of(engine)))
    compat.check_model(engine.config, engine.model.config, on_mesh=engine.mesh is not None,
                       uses=(compat.Feature.SNAPSHOT,))


# ----------------------------------------------------------------------------- provenance


def provenance_parts(engine: Engine) -> dict[str, str | int]:
    """The readable parts of the engine's KV provenance (see `Engine.provenance`)."""
    tokenizer = engine.model.tokenizer
    return dict(
        model=engine.model.config.name,
        weights_version=engine.model.weights_version,
        tokenizer=str(getattr(tokenizer, "fingerprint", type(tokenizer).__name__)),
        codec=str(engine.kv.codec_name),
        kv_dtype=jnp.dtype(engine.kv_dtype).name,
        layout=engine.config.kv_layout.value,
        page_size=engine.config.page_size,
    )


def _page_shapes(engine: Engine) -> list[list]:
    """Per page leaf, then per sequence-slot leaf (KIVI windows): [L, dims of one page or slot...]
    and its dtype, which saved pages and windows must match."""
    return [[int(x.shape[0]), *map(int, x.shape[2:]), jnp.dtype(x.dtype).name]
            for x in [*engine.kv.page_leaves(), *engine.kv.seq_slot_leaves()]]


# ----------------------------------------------------------------------------- records


def _seq_record(seq: Sequence) -> dict:
    record = {}
    for field in dataclasses.fields(Sequence):
        value = getattr(seq, field.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, SamplingParams | SLO):
            value = dataclasses.asdict(value)
        record[field.name] = value
    record["draft_tokens"] = []  # Unverified, and their K/V is not saved: drafted again.
    del record["paid_chain"]  # Hashes of its own tokens, computed again when needed.
    # A grammar is saved as data; the matcher is host state, rebuilt on restore.
    grammar = seq.sampling.grammar
    record["sampling"]["grammar"] = None if grammar is None else dict(
        kind=grammar.kind.value, source=grammar.source)
    record["grammar"] = None
    return record


def _seq_from_record(engine: Engine, record: dict, offset: float) -> Sequence:
    sampling = dict(record["sampling"])
    if sampling.get("grammar") is not None:
        sampling["grammar"] = Grammar(GrammarKind(sampling["grammar"]["kind"]),
                                      sampling["grammar"]["source"])
    seq = Sequence(**{k: v for k, v in record.items()
                      if k not in ("sampling", "status", "finish_reason", "slo", "grammar")},
                   sampling=SamplingParams(**sampling),
                   slo=SLO(**record.get("slo", {})))
    if seq.sampling.grammar is not None and not seq.is_prefill_only:
        # The matcher at the sequence's position: its output so far replayed.
        seq.grammar = engine.grammar_matcher(seq.request_id, seq.sampling.grammar,
                                             seq.output_ids)
    if record["finish_reason"] is not None:
        seq.finish_reason = FinishReason(record["finish_reason"])
    seq.status = SeqStatus(record["status"])
    seq.arrival_time += offset
    seq.token_times = [t + offset for t in seq.token_times]
    if seq.first_scheduled_time is not None:
        seq.first_scheduled_time += offset
    return seq


def _has_device_kv(engine: Engine, seq: Sequence) -> bool:
    loading = engine.tiers is not None and engine.tiers.is_loading(seq.seq_id)
    return (seq.status is SeqStatus.RUNNING and seq.num_computed > 0 and not loading
            and engine.allocator.has_sequence(seq.seq_id))


# ----------------------------------------------------------------------------- save


def save_snapshot(engine: Engine, directory: str | os.PathLike, *,
                  request_ids: Seq[str] | None = None) -> Path:
    """Saves unfinished requests (all, or `request_ids`) and their KV pages; call between steps.

    The engine is not changed: to migrate requests, save them, then `engine.abort` them here
    and `restore_snapshot` them into the other engine.

    Returns:
      The snapshot directory (absolute).
    Raises:
      ValueError: an unknown (or already finished) request id, `directory` already exists, or
        a setting the compatibility table refuses with snapshots.
    """
    path = Path(directory).expanduser().resolve()
    if path.exists():
        raise ValueError(f"snapshot directory {path} already exists")
    _check_pages_hold_all_kv(engine)
    engine.drain()
    scheduler = engine.scheduler
    chosen = scheduler.request_ids() if request_ids is None else list(request_ids)
    for request_id in chosen:
        if not scheduler.has_request(request_id):
            raise ValueError(f"request {request_id!r} is not an unfinished request of the engine")
    page_size = engine.config.page_size
    saved_pages: dict[int, int] = {}  # pool page -> index in the saved arrays
    window_slots: list[int] = []  # the saved sequences' window slots, in saved order
    has_windows = bool(engine.kv.seq_slot_leaves())
    sequences, requests = [], {}
    for request_id in chosen:
        meta = scheduler.request_meta(request_id)
        seqs = scheduler.sequences(request_id)
        requests[request_id] = dict(
            prompt=list(meta["prompt"]), arrival=meta["arrival"], tenant=meta["tenant"],
            n=meta["n"], finish_time=meta.get("finish_time"),
            seq_ids=[s.seq_id for s in seqs])
        for seq in seqs:
            seq_id = seq.seq_id
            pages, group_pages, window, retention, kv_floor = [], [], None, None, 0
            if _has_device_kv(engine, seq):
                kv_floor = engine.kv_cache.floors.floor(seq_id)
                held = engine.kv_cache.cached_len(seq_id, seq.num_computed)
                tables = engine.allocator.block_tables(seq_id)
                # Tables that keep budgets of their own hold their own cached lengths.
                shifts = engine.retention.group_shifts(seq_id) or [0] * len(tables)
                tables = [t[:pages_for(held + d, page_size)]
                          for t, d in zip(tables, shifts, strict=True)]
                pages, *group_pages = [[saved_pages.setdefault(p, len(saved_pages))
                                        if p != RELEASED else RELEASED for p in t]
                                       for t in tables]
                retention = engine.retention.record(seq_id)
                if has_windows:
                    window = len(window_slots)
                    window_slots.append(engine.kv_cache.seq_slot(seq_id))
            sequences.append(dict(record=_seq_record(seq), pages=pages,
                                  group_pages=group_pages, window=window,
                                  retention=retention, kv_floor=kv_floor,
                                  fingerprint=engine.provenance(seq.tenant,
                                                                seq.weights_version).hex()))
    meta = dict(format=SNAPSHOT_FORMAT, provenance=provenance_parts(engine),
                page_shapes=_page_shapes(engine), clock=engine.clock(),
                num_saved_pages=len(saved_pages), num_saved_windows=len(window_slots),
                requests=requests, sequences=sequences)
    items = dict(meta=ocp.args.JsonSave(meta))
    if saved_pages:
        pool_pages = np.fromiter(saved_pages, np.int32, len(saved_pages))
        leaves = kv_pages.gather_pages(engine.kv, pool_pages)  # [L, n, ...] each
        items["kv"] = ocp.args.StandardSave({f"leaf_{i}": x for i, x in enumerate(leaves)})
    if window_slots:
        windows = kv_pages.gather_seq_slots(engine.kv, np.asarray(window_slots, np.int32))
        items["windows"] = ocp.args.StandardSave(
            {f"leaf_{i}": x for i, x in enumerate(windows)})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.Composite(**items))
    return path


# ----------------------------------------------------------------------------- restore


def _check_compatible(engine: Engine, meta: dict) -> None:
    """Raises ValueError naming the first provenance part that differs from the engine's."""
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"snapshot format {meta.get('format')!r} is not {SNAPSHOT_FORMAT}")
    saved, here = meta["provenance"], provenance_parts(engine)
    live_versions = set(engine.runner.params) | {engine.model.weights_version}
    for seq in meta["sequences"]:
        version = seq["record"]["weights_version"]
        if version not in live_versions:
            raise ValueError(f"snapshot weights version {version!r} (sequence "
                             f"{seq['record']['seq_id']!r}) does not match the engine's weights "
                             f"version {engine.model.weights_version!r}")
    for key, value in saved.items():
        if key != "weights_version" and here[key] != value:
            raise ValueError(f"snapshot {key} {value!r} does not match the engine's {key} "
                             f"{here[key]!r}")
    if meta["page_shapes"] != _page_shapes(engine):
        raise ValueError(f"snapshot KV page shapes {meta['page_shapes']} do not match the "
                         f"engine's {_page_shapes(engine)}")
    for seq in meta["sequences"]:
        record = seq["record"]
        if engine.provenance(record["tenant"], record["weights_version"]).hex() != \
                seq["fingerprint"]:
            raise ValueError(f"sequence {record['seq_id']!r}: the snapshot's KV provenance "
                             "fingerprint does not match the engine's")
    for seq in meta["sequences"]:
        tables = 1 + len((seq.get("retention") or {}).get("groups", ()))
        if seq.get("retention") is not None and tables != engine.retention.num_tables:
            raise ValueError(f"sequence {seq['record']['seq_id']!r}: the snapshot's retention "
                             f"record keeps {tables} block tables, the engine's retention "
                             f"schedule {engine.retention.num_tables}")
    for request_id in meta["requests"]:
        if engine.scheduler.has_request(request_id):
            raise ValueError(f"request {request_id!r} already exists in the engine")


def _scatter_indices(seq_id: str, saved_tables: list[list[int]], tables: list[list[int]],
                     first: int) -> tuple[np.ndarray, np.ndarray]:
    """(saved page indices [n], pool pages [n]) for the pages a restored sequence's tables
    take from entry `first` on, every layer group's (a window's released entries skipped)."""
    pairs = [(saved[first + i], page) for saved, table in zip(saved_tables, tables, strict=True)
             for i, page in enumerate(table) if page != RELEASED]
    if any(src == RELEASED for src, _ in pairs):
        raise ValueError(f"sequence {seq_id!r}: the snapshot lacks pages its windows read")
    src, dst = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(src, np.int32), np.asarray(dst, np.int32)


def _place(engine: Engine, seq: Sequence, saved: dict, stored: list[jax.Array] | None,
           windows: list[jax.Array] | None) -> None:
    """Gives a restored sequence its KV (pages from the prefix cache or saved, its window and
    retention record), else waits it."""
    has_kv = False
    pages, window = saved["pages"], saved.get("window")
    saved_tables = [pages, *saved.get("group_pages", [])]
    if pages and seq.status is SeqStatus.RUNNING:
        def scatter(kv, tables, first):
            src, dst = _scatter_indices(seq.seq_id, saved_tables, tables, first)
            kv = kv_pages.scatter_pages(kv, dst, kv_pages.take(stored, src))
            if window is None:
                return kv
            slot = np.asarray([engine.kv_cache.seq_slot(seq.seq_id)], np.int32)
            blob = kv_pages.take(windows, np.asarray([window], np.int32))
            return kv_pages.scatter_seq_slots(kv, slot, blob)

        if seq.inplace_bits:  # its saved rows are rounded: they must not feed the index
            engine.kv_cache.rounded.round_pages(seq.seq_id, ())
        has_kv = engine.kv_cache.returning.place(
            seq.seq_id, seq.tokens, seq.num_computed, engine.scheduler.cache_key(seq),
            seq.weights_version, [len(t) for t in saved_tables], scatter,
            retention=saved.get("retention"), kv_floor=saved.get("kv_floor", 0))
    engine.scheduler.restore_sequence(seq, has_kv=has_kv)


def restore_snapshot(engine: Engine, directory: str | os.PathLike) -> list[str]:
    """Restores a snapshot's requests into `engine` (of the same model and KV configuration).

    Running sequences get pages (restored from the snapshot, or shared through the engine's
    prefix cache) and continue where they stopped; when the pool has no room for one, it is
    queued as waiting and recomputed. Nothing changes when validation fails.

    Returns:
      The restored request ids.
    Raises:
      ValueError: the snapshot's provenance (weights version, model, tokenizer, codec, KV dtype,
        layout, page size, page shapes) differs from the engine's, or a request id exists.
    """
    path = Path(directory).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"no snapshot directory at {path}")
    _check_pages_hold_all_kv(engine)
    engine.drain()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = checkpointer.restore(path, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        _check_compatible(engine, meta)
        stored = None
        if meta["num_saved_pages"]:
            kv = checkpointer.restore(path, args=ocp.args.Composite(
                kv=ocp.args.StandardRestore()))["kv"]
            stored = [kv[f"leaf_{i}"] for i in range(len(kv))]
        windows = None
        if meta.get("num_saved_windows"):
            blob = checkpointer.restore(path, args=ocp.args.Composite(
                windows=ocp.args.StandardRestore()))["windows"]
            windows = [blob[f"leaf_{i}"] for i in range(len(blob))]
    offset = engine.clock() - meta["clock"]
    for request_id, request in meta["requests"].items():
        record = dict(prompt=request["prompt"], arrival=request["arrival"] + offset,
                      tenant=request["tenant"], n=request["n"])
        if request["finish_time"] is not None:
            record["finish_time"] = request["finish_time"] + offset
        engine.scheduler.restore_request(request_id, request["seq_ids"], record)
    for saved in meta["sequences"]:
        _place(engine, _seq_from_record(engine, saved["record"], offset), saved, stored,
               windows)
    return list(meta["requests"])
