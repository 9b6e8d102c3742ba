"""The scheduler and the KV cache manager's host side import no jax: a router, a simulator or
a replay of recorded decisions runs them in a process without an accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOST_MODULES = (
    "kvjax.scheduler",
    "kvjax.scheduler.replay",
    "kvjax.memory",
    "kvjax.memory.block_manager",
    "kvjax.memory.groups",
    "kvjax.memory.prefix_cache",
    "kvjax.memory.kv_cache_manager",
    "kvjax.memory.ops",
    "kvjax.memory.tiers",  # the tiers' ledger; the runner's TierTransfers load on use
    "kvjax.memory.tiers.manager",
    "kvjax.kv.retention_host",
    "kvjax.sampling_params",
)


def _run(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, check=True, cwd=REPO)
    return result.stdout


def test_host_modules_import_no_jax():
    # One fresh interpreter imports the modules in turn: the first that loads a device library
    # is the one named (every later one would find it loaded already).
    script = (
        "import importlib, json, sys\n"
        "first = None\n"
        f"for module in {HOST_MODULES!r}:\n"
        "    importlib.import_module(module)\n"
        "    loaded = sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules)\n"
        "    if loaded and first is None:\n"
        "        first = [module, loaded]\n"
        "print(json.dumps(first))\n"
    )
    assert json.loads(_run(script)) is None


def test_public_names_still_load_on_use():
    # The package's public names stay importable from the top, each loading its module on
    # first use (a host-side one loads no jax; the engine's tests import the rest).
    script = ("import sys, kvjax\n"
              "from kvjax import SLO, Segment\n"
              "from kvjax.scheduler.controller import SLO as defined\n"
              "print(SLO is defined, set(kvjax.__all__) <= set(dir(kvjax)), 'jax' in sys.modules)")
    assert _run(script).split() == ["True", "True", "False"]
