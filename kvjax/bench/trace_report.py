"""Analyses of a KV-semantic trace (`kvjax.trace`), after production-trace studies
(KVCacheInTheWild): prefix hit rate per tenant and over time, page lifetimes and reuse
distances, pages per tier over time, time requests wait on tier transfers.

Works on the exported Trace Event Format JSON, so any saved trace can be re-analysed.
"""

from __future__ import annotations

import collections
import os

import numpy as np

_PHASE_KEYS = {"X": ("name", "ph", "ts", "pid", "tid", "dur"),
               "i": ("name", "ph", "ts", "pid", "tid"),
               "C": ("name", "ph", "ts", "pid", "args"),
               "M": ("name", "ph", "pid", "args")}


def validate_trace(trace: dict) -> list[str]:
    """Trace Event Format checks (required keys per phase, numeric counters, spans with a
    non-negative duration, each track's spans nested); returns the problems found."""
    problems = []
    spans = collections.defaultdict(list)
    for i, e in enumerate(trace.get("traceEvents", [])):
        keys = _PHASE_KEYS.get(e.get("ph"))
        if keys is None:
            problems.append(f"event {i}: unknown phase {e.get('ph')!r}")
            continue
        problems += [f"event {i}: no {k!r}" for k in keys if k not in e]
        if e["ph"] == "C" and not all(isinstance(v, (int, float)) for v in e["args"].values()):
            problems.append(f"event {i}: counter values must be numbers")
        if e["ph"] == "X":
            if e.get("dur", -1) < 0:
                problems.append(f"event {i}: negative duration")
            spans[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    for track, items in spans.items():
        ends = []
        for start, end in sorted(items):
            while ends and ends[-1] <= start:
                ends.pop()
            if ends and end > ends[-1]:
                problems.append(f"track {track}: span at {start} overlaps its parent")
            ends.append(end)
    return problems


def _summary(values) -> dict:
    if not len(values):
        return dict(count=0)
    v = np.asarray(values, np.float64)
    return dict(count=int(v.size), mean=float(v.mean()), p50=float(np.percentile(v, 50)),
                p90=float(np.percentile(v, 90)), max=float(v.max()))


def _events(trace: dict) -> list[dict]:
    return sorted((e for e in trace["traceEvents"] if e["ph"] != "M"), key=lambda e: e["ts"])


def _hit_rates(events: list[dict], num_windows: int) -> dict:
    """Token-weighted prefix hit rate overall, per tenant, and over `num_windows` windows."""
    lookups = [e for e in events if e["name"] in ("prefix_hit", "prefix_miss")]
    rate = lambda es: (sum(e["args"]["hit_tokens"] for e in es)  # noqa: E731
                       / max(sum(e["args"]["tokens"] for e in es), 1))
    by_tenant = collections.defaultdict(list)
    for e in lookups:
        by_tenant[e["args"]["tenant"]].append(e)
    windows = np.array_split(np.asarray(lookups, object), num_windows) if lookups else []
    return dict(overall=rate(lookups), lookups=len(lookups),
                per_tenant={t: rate(es) for t, es in by_tenant.items()},
                over_time=[rate(list(w)) for w in windows if len(w)])


def _page_lives(events: list[dict]) -> tuple[list[float], list[int]]:
    """Seconds from each allocation to its free or eviction; and reuse distances: pages
    allocated between a page's consecutive allocations."""
    born, last_alloc, lives, reuse = {}, {}, [], []
    num_allocs = 0
    for e in events:
        page = e["args"].get("page")
        if e["name"] == "allocate":
            if page in last_alloc:
                reuse.append(num_allocs - last_alloc[page])
            born[page], last_alloc[page] = e["ts"], num_allocs
            num_allocs += 1
        elif e["name"] in ("free", "evict") and page in born:
            lives.append((e["ts"] - born.pop(page)) / 1e6)
    return lives, reuse


def _transfer_waits(events: list[dict]) -> dict[str, float]:
    """Per waiting sequence, seconds from its first load transfer queued to its last commit."""
    spans: dict[str, list[float]] = {}
    for e in events:
        owner = e["args"].get("owner") if e.get("cat") == "transfer" else None
        if owner and owner != "None":
            span = spans.setdefault(owner, [e["ts"], e["ts"]])
            span[1] = e["ts"]
    return {o: (b - a) / 1e6 for o, (a, b) in spans.items()}


_GONE = {"evict": "evicted", "invalidate": "invalidated"}


def lookup_losses(events: list[dict]) -> dict:
    """Why prefix lookups stopped short, and which demoted pages were wanted later.

    Replays the index from the trace (`index`, `evict`, `invalidate`, `demote_page` events,
    in order; a `weights_update` empties it) and, for each `prefix_lookup`, finds the first
    page of the chain it wanted that it did not get: a page demoted in place, evicted or
    invalidated since it was indexed, never indexed before the lookup ("never cached": not
    computed yet, computed by a sequence that fed the index no more, or its last token's
    page), or one the index held ("in index": a hit the lookup was not allowed to take).

    A waiting sequence is looked up again at each step it is not admitted, so each reason
    also counts the distinct sequences that stopped there at least once.

    Returns: lookups; per reason, the lookups that stopped there ("stopped"), the wanted
    pages they missed ("pages_missed"; "full" for lookups that got every page wanted) and
    the sequences ("sequences"); and
    the pages demoted in place: all, those the index held then, and those whose hash a later
    lookup wanted (`later_wanted`, and of those the index held `later_wanted_indexed`).
    """
    index: dict[str, int] = {}  # hash -> page
    hash_of: dict[int, str] = {}  # indexed page -> hash
    gone: dict[str, str] = {}  # hash -> why it left the index
    demoted: dict[str, bool] = {}  # demoted page's hash -> whether it was indexed then
    wanted_later: set[str] = set()
    stopped, missed = collections.Counter(), collections.Counter()
    seqs: dict[str, set[str]] = collections.defaultdict(set)
    num_demoted = num_demoted_indexed = num_lookups = 0

    def drop(page, reason: str) -> None:
        h = hash_of.pop(page, None)
        if h is not None:
            index.pop(h, None)
            gone[h] = reason

    for e in events:
        name, args = e["name"], e.get("args") or {}
        if name == "index":
            index[args["hash"]], hash_of[args["page"]] = args["page"], args["hash"]
            gone.pop(args["hash"], None)
        elif name in _GONE:
            drop(args["page"], _GONE[name])
        elif name == "weights_update":
            for page in list(hash_of):
                drop(page, "invalidated")
        elif name == "demote_page":
            h = hash_of.get(args["page"]) if args["indexed"] else args.get("hash")
            if args["indexed"]:
                drop(args["page"], "demoted")
            num_demoted += 1
            num_demoted_indexed += bool(args["indexed"])
            if h is not None:
                demoted[h] = demoted.get(h, False) or bool(args["indexed"])
        elif name == "prefix_lookup":
            num_lookups += 1
            wanted, hit = args["wanted"], args["hit_pages"]
            wanted_later.update(h for h in wanted if h in demoted)
            if hit >= len(wanted):
                reason = "full"
            else:
                stop = wanted[hit]
                reason = gone.get(stop, "in index" if stop in index else "never cached")
                missed[reason] += len(wanted) - hit
            stopped[reason] += 1
            seqs[reason].add(args["seq_id"])
    return dict(lookups=num_lookups, stopped=dict(stopped), pages_missed=dict(missed),
                sequences={reason: len(s) for reason, s in seqs.items()},
                demoted_pages=num_demoted, demoted_indexed=num_demoted_indexed,
                later_wanted=len(wanted_later),
                later_wanted_indexed=sum(demoted[h] for h in wanted_later))


def analyse(trace: dict, *, num_windows: int = 10) -> dict:
    """The report as JSON-ready data (times in seconds of the host's clock; counter times
    from the trace's first event)."""
    events = _events(trace)
    lives, reuse = _page_lives(events)
    t0 = events[0]["ts"] if events else 0.0
    counters = [dict(t_s=(e["ts"] - t0) / 1e6, **e["args"]) for e in events if e["ph"] == "C"]
    waits = _transfer_waits(events)
    return dict(num_events=len(events), num_steps=sum(e["name"] == "step" for e in events),
                prefix_hit_rate=_hit_rates(events, num_windows),
                page_lifetime_s=_summary(lives), reuse_distance_pages=_summary(reuse),
                transfer_wait_s=_summary(list(waits.values())),
                pages_per_tier=counters, lookup_losses=lookup_losses(events),
                event_counts=dict(collections.Counter(e["name"] for e in events)))


def format_tables(report: dict) -> str:
    """The report's scalar parts as plain-text tables."""
    lines = [f"events {report['num_events']}, steps {report['num_steps']}",
             f"prefix hit rate {report['prefix_hit_rate']['overall']:.3f} "
             f"over {report['prefix_hit_rate']['lookups']} lookups", "tenant      hit rate"]
    lines += [f"{t:<11} {r:.3f}" for t, r in report["prefix_hit_rate"]["per_tenant"].items()]
    lines.append(f"{'distribution':<22} {'count':>7} {'p50':>10} {'p90':>10} {'max':>10}")
    for key in ("page_lifetime_s", "reuse_distance_pages", "transfer_wait_s"):
        s = report[key]
        lines.append(f"{key:<22} {s['count']:>7} " + " ".join(
            f"{s.get(k, float('nan')):>10.4g}" for k in ("p50", "p90", "max")))
    lines += [f"{name:<22} {n:>7}" for name, n in sorted(report["event_counts"].items())]
    lines.append(format_losses(report["lookup_losses"]))
    return "\n".join(lines)


def format_losses(losses: dict) -> str:
    """`lookup_losses` as a table: why lookups stopped short, and demoted pages wanted later."""
    lines = [f"prefix lookups {losses['lookups']}", f"{'stopped at':<14} {'lookups':>8} "
             f"{'pages missed':>13} {'sequences':>10}"]
    lines += [f"{reason:<14} {n:>8} {losses['pages_missed'].get(reason, 0):>13} "
              f"{losses['sequences'][reason]:>10}"
              for reason, n in sorted(losses["stopped"].items())]
    lines.append(f"pages demoted in place {losses['demoted_pages']} (indexed then "
                 f"{losses['demoted_indexed']}); wanted by a later lookup "
                 f"{losses['later_wanted']} (indexed then {losses['later_wanted_indexed']})")
    return "\n".join(lines)


def plot(report: dict, trace: dict, workdir: str | os.PathLike) -> list[str]:
    """PNG plots: hit rate over time, page lifetimes and reuse distances, pages per tier."""
    import matplotlib  # Imported lazily: only plotting needs it.

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lives, reuse = _page_lives(_events(trace))
    paths = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.5))
    axes[0].plot(report["prefix_hit_rate"]["over_time"], marker="o")
    axes[0].set(title="prefix hit rate over time", xlabel="window", ylim=(0, 1))
    axes[1].hist(lives, bins=40)
    axes[1].set(title="page lifetime", xlabel="s")
    axes[2].hist(reuse, bins=40)
    axes[2].set(title="reuse distance", xlabel="pages allocated between")
    rows = report["pages_per_tier"]
    for tier in sorted({k for r in rows for k in r} - {"t_s"}):
        axes[3].plot([r["t_s"] for r in rows], [r.get(tier, 0) for r in rows], label=tier)
    axes[3].set(title="pages per tier", xlabel="s")
    axes[3].legend()
    fig.tight_layout()
    path = os.path.join(workdir, "trace_report.png")
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths
