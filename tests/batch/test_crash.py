"""A batch job killed with SIGKILL and re-run writes each id exactly once, with the greedy
tokens of an uninterrupted run (the oracle: cache-free greedy decoding of each prompt)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvjax.batch import run_batch
from kvjax.engine.config import EngineConfig
from kvjax.models.loading import load_model
from kvjax.testing import greedy_reference, save_hf_checkpoint, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "batch_infer.py")
NUM_REQUESTS = 24
CONFIG = EngineConfig(page_size=16, max_num_seqs=4)  # The script's flags below.


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(checkpoint, input, each id's oracle tokens) shared by every kill point."""
    root = tmp_path_factory.mktemp("crash")
    checkpoint, model = root / "tiny", tiny_model()
    save_hf_checkpoint(model, checkpoint)
    rng = np.random.default_rng(0)
    bases = [rng.integers(3, 120, 30).tolist() for _ in range(4)]
    lines = [{"id": f"r{i}", "prompt_ids": bases[i % 4] + rng.integers(3, 120, 6).tolist(),
              "max_tokens": 8, "ignore_eos": True} for i in range(NUM_REQUESTS)]
    (root / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    oracle = {line["id"]: greedy_reference(model, line["prompt_ids"], 8) for line in lines}
    return checkpoint, root / "in.jsonl", oracle


def _read(path) -> dict[str, list[int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({line["id"] for line in lines}) == len(lines), "an id was written twice"
    return {line["id"]: line["tokens"] for line in lines}


def _run_killed(checkpoint, input_path, output, kill_after_lines: int) -> None:
    """Starts the script and SIGKILLs it once the output holds `kill_after_lines` lines
    (0: as soon as the process is up, before any output)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, f"--model={checkpoint}", f"--input={input_path}",
         f"--output={output}", "--order=prefix", "--max_num_seqs=4", "--noprogress"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while kill_after_lines and time.monotonic() < deadline and proc.poll() is None:
        if output.exists() and output.read_bytes().count(b"\n") >= kill_after_lines:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]


def _check_kill_point(job, tmp_path, kill_after_lines: int) -> None:
    checkpoint, input_path, oracle = job
    output = tmp_path / f"out{kill_after_lines}.jsonl"
    _run_killed(checkpoint, input_path, output, kill_after_lines)
    before = _read(output) if output.exists() else {}
    assert len(before) < NUM_REQUESTS, "the job finished before the kill"
    stats = run_batch(load_model(checkpoint), input_path, output, order="prefix",
                      engine_config=CONFIG)
    assert stats.num_skipped == len(before)
    assert _read(output) == oracle


def test_kill_mid_job_then_rerun_writes_each_id_once(job, tmp_path):
    _check_kill_point(job, tmp_path, 3)


@pytest.mark.parametrize("kill_after_lines", [0, 1, 12, 20])
def test_kill_at_many_points_then_rerun_writes_each_id_once(job, tmp_path, kill_after_lines):
    _check_kill_point(job, tmp_path, kill_after_lines)
