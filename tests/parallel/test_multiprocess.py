"""Two processes joined by jax.distributed drive one tp=2 engine and read the same tokens.

Each process owns one CPU device; the step's all-reduces cross processes through gloo. The
single-process, single-device engine is the oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvjax.parallel.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "multihost_demo.py")
TIMEOUT_S = 300


def _start(*flags: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, SCRIPT, *flags], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process timed out: {err[-2000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_match_a_single_process_run():
    coordinator = f"127.0.0.1:{free_port()}"
    workers = [_start("--num_processes=2", f"--process_id={i}", f"--coordinator={coordinator}",
                      "--tp=2") for i in range(2)]
    results = [_result(p) for p in workers]
    single = _result(_start("--num_processes=1", "--tp=1"))  # After: fewer processes share CPUs.
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 2 for r in results)
    assert single["processes"] == 1 and single["devices"] == 1
    assert results[0]["tokens"] == results[1]["tokens"] == single["tokens"]
    assert len(single["tokens"]) == 4 and all(len(t) == 8 for t in single["tokens"])
