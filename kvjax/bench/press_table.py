"""The press quality table: kvjax's retention rows beside kvpress's rows for the same press.

`scripts/bench_retention.py --output_json A --probes_json P` measures kvjax's presses and writes
its probes (prompt, answer and forced continuation token ids); `scripts/kvpress_peer.py`
(in kvpress's own venv) replays P with kvpress's implementation of each press and writes B;
`merge(A, B)` joins them, variant by variant (`name:budget[:option=value]`, the same names on
both sides), into one table. Each framework's KL is against its own exact run (kvjax's exact
KV engine, kvpress's uncompressed transformers cache) over the same probes and forced tokens,
so the two KL columns measure each press's loss against the same reference text, not the
frameworks' numerical differences.

Row keys: `variant`, `framework` ("kvjax" or "kvpress"), kl_mean, kl_p99, kl_max (KL(exact ||
press) over every forced token of every probe), top1_agreement, retrieval_pass (fraction of
probes), on kvjax rows with a peer, `kl_ratio` = kvjax's KL mean / kvpress's, and on kvpress
rows `press`, the kvpress class that ran (AdaKVPress and PyramidKVPress for kvjax's adakv and
pyramid schedules, the plain press for per_head, kvpress's own granularity), or None where the
report does not say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# kvjax press -> the kvpress press that implements it (a peer row is expected for these).
KVPRESS_PEERS: dict[str, str] = {
    "streaming": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "observed_attention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
}

QUALITY = ("kl_mean", "kl_p99", "kl_max", "top1_agreement", "retrieval_pass")


def combine(reports: Sequence[Mapping]) -> dict:
    """One report from several runs of one framework on the same probes (their rows, in order;
    a variant measured twice keeps its first row).

    Raises:
      ValueError: naming the prompt lengths when the runs are not on the same probes.
    """
    rows = {}
    for report in reports:
        if list(report["prompt_tokens"]) != list(reports[0]["prompt_tokens"]):
            raise ValueError(f"the runs ran different probes: prompt tokens "
                             f"{list(reports[0]['prompt_tokens'])} vs "
                             f"{list(report['prompt_tokens'])}")
        for variant, row in report["rows"].items():
            rows.setdefault(variant, row)
    return dict(rows=rows, prompt_tokens=list(reports[0]["prompt_tokens"]))


def merge(kvjax: Mapping, kvpress: Mapping) -> dict:
    """Joins a bench_retention report and a kvpress_peer report on the same probes.

    Args:
      kvjax: bench_retention's JSON (`rows`: variant -> row, `prompt_tokens`).
      kvpress: kvpress_peer's JSON (the same keys).

    Returns:
      dict(rows=[row, ...] in kvjax's variant order, each kvjax row followed by its kvpress
      row where there is one; num_probes; prompt_tokens; kl_ratio={variant: ratio}).

    Raises:
      ValueError: naming both prompt lengths when the reports are not on the same probes.
    """
    if list(kvjax["prompt_tokens"]) != list(kvpress["prompt_tokens"]):
        raise ValueError(f"the reports ran different probes: prompt tokens "
                         f"{list(kvjax['prompt_tokens'])} (kvjax) vs "
                         f"{list(kvpress['prompt_tokens'])} (kvpress)")
    rows, ratios = [], {}
    for variant, row in kvjax["rows"].items():
        if variant == "none":
            continue
        merged = dict(variant=variant, framework="kvjax", **{k: row[k] for k in QUALITY})
        rows.append(merged)
        peer = kvpress["rows"].get(variant)
        if peer is None:
            continue
        rows.append(dict(variant=variant, framework="kvpress", press=peer.get("press"),
                         **{k: peer[k] for k in QUALITY}))
        if peer["kl_mean"] > 0:
            ratios[variant] = merged["kl_ratio"] = row["kl_mean"] / peer["kl_mean"]
    return dict(rows=rows, num_probes=len(kvjax["prompt_tokens"]),
                prompt_tokens=list(kvjax["prompt_tokens"]), kl_ratio=ratios)


def format_table(table: Mapping) -> str:
    """The merged table as markdown; retrieval as probes passed / probes."""
    n = table["num_probes"]
    lines = ["| press:budget | framework | KL mean | KL p99 | KL worst | top-1 | retrieval "
             "| KL mean kvjax / kvpress |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in table["rows"]:
        name = row["variant"]
        if row["framework"] == "kvpress":
            press = row.get("press") or KVPRESS_PEERS.get(name.split(":")[0], "kvpress")
            name = f"{name} ({press})"
        ratio = f"{row['kl_ratio']:.2f}" if "kl_ratio" in row else ""
        lines.append(f"| {name} | {row['framework']} | {row['kl_mean']:.3f} | "
                     f"{row['kl_p99']:.2f} | {row['kl_max']:.2f} | "
                     f"{row['top1_agreement']:.3f} | "
                     f"{round(row['retrieval_pass'] * n)} / {n} | {ratio} |")
    return "\n".join(lines)
