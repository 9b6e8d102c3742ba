"""The KV controller benchmark: every controller on one workload, side by side in one table.

`measure_kl_tables` measures what each degradation costs in quality on the workload's own
prompts (the retention policy at each candidate budget, and K/V in the codec of each demoted
swap copy, int8 and int4, each against exact KV: `runner.measure_quality`'s mean KL per
token); the tables
become every controller's options, so the controllers price quality from measurements.
`run_controllers` then runs the config once per controller (`config.sweep` lists them) and
`controller_table` puts each run's goodput, SLO attainment per tenant, tails, estimated KL
spent, bytes per tier and energy in one markdown table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from ml_collections import ConfigDict

from kvjax.bench import runner
from kvjax.bench.energy import get_profile
from kvjax.bench.metrics import RequestRecord, format_rows, meets_slo
from kvjax.bench.workloads import BenchRequest
from kvjax.engine.swap import DEMOTION_BITS, demotion_codec
from kvjax.models.model import Model


def measure_kl_tables(config: ConfigDict, model: Model, requests: Sequence[BenchRequest],
                      budgets: Sequence[int]) -> dict[str, Any]:
    """{'retention_kl': {str(budget): mean KL}, 'demote_kl': {str(bits): mean KL}}, measured on
    `config.quality`'s prompts of `requests` for the config's retention policy and for K/V
    held in each demoted copy's codec (`kvjax.engine.swap.demotion_codec`)."""
    base = dataclasses.replace(runner.engine_config_from(config), controller="fixed",
                               controller_options={})
    retention_kl = {}
    for b in budgets:
        engine_config = dataclasses.replace(base, retention=config.kv.retention,
                                            retention_budget=int(b))
        retention_kl[str(int(b))] = runner.measure_quality(
            config, engine_config, model, requests)["kl_mean"]
    demote_kl = {}
    for bits in DEMOTION_BITS:
        codec, options = demotion_codec(bits, model.config.head_dim)
        engine_config = dataclasses.replace(base, retention="none", retention_budget=None,
                                            retention_options={}, kv_codec=codec,
                                            kv_codec_options=options)
        demote_kl[str(bits)] = runner.measure_quality(
            config, engine_config, model, requests)["kl_mean"]
    return dict(retention_kl=retention_kl, demote_kl=demote_kl)


def energy_options(config: ConfigDict, model: Model) -> dict[str, float]:
    """The controllers' energy prices from the config's energy profile: joules per byte over
    the host link and per token recomputed (2 FLOPs per parameter)."""
    profile = get_profile(config.energy_profile)
    params = sum(x.size for x in jax.tree.leaves(model.params))
    return dict(joules_per_byte=profile.pj_per_byte_host * 1e-12,
                joules_per_token=2 * params * profile.pj_per_flop * 1e-12)


def run_controllers(config: ConfigDict, options: dict[str, Any], *, model: Model,
                    progress: bool = False) -> list[runner.BenchResult]:
    """One run of `config` per entry of `config.sweep`, each controller given `options`
    (an entry's own `engine.controller_options.*` keys set after them)."""
    shared = dict(config.engine.controller_options.to_dict(), **options)
    overrides = [{"engine.controller_options": shared, **o} for o in config.sweep]
    return runner.run_sweep_detailed(config, overrides, model=model, progress=progress)


def slo_attainment(records: Sequence[RequestRecord], config: ConfigDict
                   ) -> dict[str, float]:
    """Fraction of requests that met their SLO, overall and per tenant."""
    met: dict[str, list[bool]] = {}
    for r in records:
        ok = r.error is None and meets_slo(r, config.slo.ttft_s, config.slo.tpot_s)
        met.setdefault("all", []).append(ok)
        met.setdefault(str(r.tenant), []).append(ok)
    return {k: sum(v) / len(v) for k, v in sorted(met.items())}


def controller_rows(results: Sequence[runner.BenchResult], config: ConfigDict
                    ) -> dict[str, dict[str, float]]:
    """Run name -> the columns of `controller_table` (SLO attainment keyed by tenant)."""
    rows = {}
    for result in results:
        m = result.metrics
        rows[m["config"]["name"]] = dict(
            **{f"slo_met:{t}": f for t, f in slo_attainment(result.records, config).items()},
            goodput_req_s=m["goodput_req_s"], ttft_p99_s=m["ttft_p99_s"],
            tpot_p99_s=m["tpot_p99_s"], kl_mean=m["kl_spent"]["mean"],
            kl_max=m["kl_spent"]["max"], degraded=m["kl_spent"]["degraded_requests"],
            preemptions=m["preemptions"], prefix_hit_rate=m["prefix_hit_rate"],
            host_mib=m["bytes_moved"]["host"] / 2**20,
            device_gib=m["bytes_moved"]["device"] / 2**30,
            energy_kj=m["energy_j_est"] / 1e3, duration_s=m["duration_s"])
    return rows


_COLUMNS = (("goodput_req_s", "goodput req/s", "{:.3f}"), ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
            ("tpot_p99_s", "TPOT p99 s", "{:.2f}"), ("kl_mean", "KL mean", "{:.2e}"),
            ("kl_max", "KL max", "{:.3f}"), ("degraded", "degraded", "{}"),
            ("preemptions", "preemptions", "{}"), ("prefix_hit_rate", "prefix hits", "{:.2f}"),
            ("host_mib", "host MiB", "{:.1f}"),
            ("device_gib", "device GiB", "{:.1f}"), ("energy_kj", "energy kJ", "{:.2f}"),
            ("duration_s", "duration s", "{:.1f}"))


def controller_table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table of `controller_rows`: SLO attainment (all, then each tenant) first."""
    slo = list(dict.fromkeys(k for row in rows.values() for k in row if k.startswith("slo_met")))
    columns = [(k, "SLO met " + k.split(":", 1)[1], "{:.2f}") for k in slo] + list(_COLUMNS)
    return format_rows(rows, columns, "controller")
