"""Routing policies through real processes: server replicas and the HTTP router on loopback.

    with replica_processes(config_path, num_replicas=2) as urls:
        rows = run_policies(config, urls, ("round_robin", "prefix_affinity"))

Each replica is `scripts/serve.py --config=<config_path>` (its engine section); each policy
gets a router process of its own (`scripts/router.py`) in front of the same replicas, and
replays the config's workload through it with `kvjax.bench.remote` (serve_bench --target).
Each policy's workload uses its own seed, so no policy reads pages another one cached; prefix
hits are the replicas' counters (summed by the router's /metrics) over that policy's run.

`run_disaggregation` replays the workload colocated (the router over every replica),
disaggregated (the first replica prefills, the others decode: `--prefill_replica`) and with
alternating phases (every replica prefills in its own window of each period:
`--phase_period_s`, `kvjax.router.phases`), each with its own seed, and reads the KV bytes the
router moved per request from its /metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from ml_collections import ConfigDict
from prometheus_client.parser import text_string_to_metric_families

from kvjax.bench.remote import run_http_benchmark_detailed
from kvjax.bench.runner import build_workload
from kvjax.bench.workloads import Tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port no one listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoggedProcess(subprocess.Popen):
    """A process whose output goes to a temporary file (a pipe nobody reads would block it
    once it has written the pipe's buffer full); `env` entries are added to this one's.

    With `own_group`, it leads a process group of its own, and `stop` ends the whole group
    (SIGTERM, then SIGKILL after `grace_s`): for servers that start worker processes.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, *,
                 own_group: bool = False, grace_s: float = 30.0):
        self.log = tempfile.TemporaryFile()
        self.own_group, self.grace_s = own_group, grace_s
        super().__init__(list(argv), cwd=ROOT, env=dict(os.environ, **(env or {})),
                         stdout=self.log, stderr=subprocess.STDOUT,
                         start_new_session=own_group)

    def output_tail(self, num_chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """Kills it (if still running; its group with `own_group`), reaps it and drops its
        output."""
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.wait(self.grace_s)
                os.killpg(self.pid, signal.SIGKILL)
        elif self.poll() is None:
            self.kill()
        self.wait()
        self.log.close()


class ScriptProcess(LoggedProcess):
    """A `scripts/<script>` process run by this interpreter, kvjax importable from ROOT."""

    def __init__(self, script: str, args: Sequence[str]):
        super().__init__([sys.executable, str(ROOT / "scripts" / script), *args],
                         env=dict(PYTHONPATH=str(ROOT)))


def wait_healthy(url: str, process: LoggedProcess, timeout_s: float) -> None:
    """Waits for GET url/health to answer 200; RuntimeError if the process exits first or the
    time runs out (the process is killed then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{url} did not come up: {process.output_tail()}")
        time.sleep(0.25)


@contextlib.contextmanager
def replica_processes(server_args: Sequence[str], num_replicas: int, *,
                      timeout_s: float = 600.0) -> Iterator[list[tuple[str, ScriptProcess]]]:
    """Starts `num_replicas` `scripts/serve.py` processes with `server_args` on free ports;
    yields (base URL, process) pairs once all are healthy; kills the survivors at exit."""
    started = []
    try:
        for _ in range(num_replicas):
            port = free_port()
            started.append((f"http://127.0.0.1:{port}", ScriptProcess(
                "serve.py", [f"--port={port}", "--log_level=warning", *server_args])))
        for url, process in started:
            wait_healthy(url, process, timeout_s)
        yield started
    finally:
        for _, process in started:
            process.stop()


@contextlib.contextmanager
def router_process(replica_urls: Sequence[str], policy: str, *, args: Sequence[str] = (),
                   timeout_s: float = 120.0) -> Iterator[str]:
    """Starts `scripts/router.py` over the replicas; yields its base URL once healthy."""
    port = free_port()
    process = ScriptProcess("router.py", [f"--port={port}",
                                          f"--replica={','.join(replica_urls)}",
                                          f"--policy={policy}", "--log_level=warning", *args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s)
        yield url
    except Exception as e:
        e.add_note(f"router output: {process.output_tail()}")
        raise
    finally:
        process.stop()


def run_policies(config: ConfigDict, replica_urls: Sequence[str], policies: Sequence[str],
                 tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """Replays the config's workload through a router per policy; one row per policy."""
    rows = []
    for i, policy in enumerate(policies):
        run_config = ConfigDict(config.to_dict())
        run_config.workload.seed = int(config.workload.seed) + i
        requests = build_workload(run_config, tokenizer)
        with router_process(replica_urls, policy) as url:
            result = run_http_benchmark_detailed(run_config, url, requests=requests)
        metrics = result.metrics
        rows.append(dict(policy=policy, num_replicas=len(replica_urls),
                         num_requests=metrics["num_requests"],
                         num_failed=metrics["failed_requests"],
                         errors=sorted({r.error for r in result.records if r.error}),
                         prefix_hit_rate=metrics["prefix_hit_rate"],
                         ttft_p50_s=metrics["ttft_p50_s"], ttft_p99_s=metrics["ttft_p99_s"],
                         throughput_tok_s=metrics["throughput_tok_s"]))
    return rows


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` matching `labels` on a server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def run_disaggregation(config: ConfigDict, replica_urls: Sequence[str], policy: str,
                       tokenizer: Tokenizer, *, phase_period_s: float = 4.0
                       ) -> list[dict[str, Any]]:
    """The config's workload colocated, then disaggregated (replica 0 prefills, the rest
    decode), then with alternating phases (`phase_period_s`), through router processes; one
    row per mode."""
    if len(replica_urls) < 2:
        raise ValueError(f"disaggregation needs 2 or more replicas, got {len(replica_urls)}")
    modes = (("colocated", list(replica_urls), []),
             ("disaggregated", list(replica_urls[1:]), [f"--prefill_replica={replica_urls[0]}"]),
             ("alternating", list(replica_urls), [f"--phase_period_s={phase_period_s}"]))
    rows = []
    for i, (mode, decode_urls, args) in enumerate(modes):
        run_config = ConfigDict(config.to_dict())
        run_config.workload.seed = int(config.workload.seed) + 100 + i
        requests = build_workload(run_config, tokenizer)
        with router_process(decode_urls, policy, args=args) as url:
            result = run_http_benchmark_detailed(run_config, url, requests=requests)
            moved = metric_sum(url, "kvjax:router_kv_transfer_bytes_total")
        metrics = result.metrics
        rows.append(dict(mode=mode, policy=policy, num_replicas=len(replica_urls),
                         num_requests=metrics["num_requests"],
                         num_failed=metrics["failed_requests"],
                         errors=sorted({r.error for r in result.records if r.error}),
                         prefix_hit_rate=metrics["prefix_hit_rate"],
                         ttft_p50_s=metrics["ttft_p50_s"], ttft_p99_s=metrics["ttft_p99_s"],
                         throughput_tok_s=metrics["throughput_tok_s"],
                         kv_bytes_per_request=moved / max(metrics["num_requests"], 1)))
    return rows


def disaggregation_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of `run_disaggregation` as a markdown table."""
    lines = ["| mode | requests (failed) | prefix hit rate | TTFT p50 / p99 (s) | tokens/s | "
             "KV MiB moved per request |", "|---|---|---|---|---|---|"]
    for r in rows:
        hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.3f}"
        lines.append(f"| {r['mode']} | {r['num_requests']} ({r['num_failed']}) | {hit} | "
                     f"{r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} | "
                     f"{r['throughput_tok_s']:.1f} | {r['kv_bytes_per_request'] / 2**20:.2f} |")
    return "\n".join(lines)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| policy | replicas | requests (failed) | prefix hit rate | TTFT p50 / p99 (s) | "
             "tokens/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.3f}"
        lines.append(f"| {r['policy']} | {r['num_replicas']} | {r['num_requests']} "
                     f"({r['num_failed']}) | {hit} | {r['ttft_p50_s']:.3f} / "
                     f"{r['ttft_p99_s']:.3f} | {r['throughput_tok_s']:.1f} |")
    return "\n".join(lines)


def write(rows: Sequence[dict[str, Any]], workdir: str | os.PathLike,
          name: str = "router_http.json") -> pathlib.Path:
    """Writes the rows as `name` under `workdir`; returns its path."""
    path = pathlib.Path(workdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(rows), indent=2))
    return path
