#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the Pallas kernel tests compiled on the GPU (not
# interpreted), then scripts/kernel_bench.py at 32k context. Bounded to about 8 minutes.
#
#   scripts/device_check.sh            # from any directory
#
# Results go to $OUT, or ./device_results when OUT is unset: env.txt (GPU, versions),
# tests_fast.log/.xml, tests_slow.log/.xml, kernel_bench.log, kernel_bench.json, summary.txt.
# The exit status is non-zero if any step failed; every step runs regardless.
#
# Assumptions: a CUDA 12 capable driver; python3 >= 3.11 on PATH (or $PYTHON). If that Python
# already imports jax with a GPU backend plus kvjax's dependencies, it is used as is. Otherwise a
# venv ($DEVICE_VENV, default .venv-gpu in the repo) gets jax[cuda12]==$JAX_VERSION (default the
# version this repo is tested with), kvjax (editable) and pytest from PyPI: network access and
# about 3 GB of CUDA wheels, capped at 180 s.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/device_results}"
mkdir -p "$OUT_DIR"
PYTHON="${PYTHON:-python3}"
JAX_VERSION="${JAX_VERSION:-0.10.2}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

note() { echo "[device_check] $*" | tee -a "$SUMMARY"; }

# Usable when it imports everything the tests and the benchmark import, on a GPU backend.
ready() {
  "$1" -c 'import jax, flax, absl, pytest, pytest_timeout, kvjax, pallas_kernels
assert jax.default_backend() == "gpu", jax.default_backend()' >/dev/null 2>&1
}

if ready "$PYTHON"; then
  PY="$PYTHON"
else
  VENV="${DEVICE_VENV:-$ROOT/.venv-gpu}"
  if ! ready "$VENV/bin/python"; then
    note "installing jax[cuda12]==$JAX_VERSION and kvjax into $VENV"
    "$PYTHON" -m venv "$VENV"
    timeout 180 "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      "jax[cuda12]==$JAX_VERSION" -e . pytest pytest-timeout \
      >"$OUT_DIR/install.log" 2>&1 || note "pip install failed, see install.log"
  fi
  PY="$VENV/bin/python"
fi
if ! ready "$PY"; then
  note "FAILED: $PY cannot import jax on a GPU backend with kvjax's dependencies"
  "$PY" -c 'import jax; print(jax.devices())' >>"$SUMMARY" 2>&1 || true
  exit 1
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)'
  "$PY" -c 'import jax; print(jax.devices())'
} >"$OUT_DIR/env.txt" 2>&1

status=0
# step NAME SECONDS COMMAND...: runs under a timeout, logs to $OUT_DIR/NAME.log, records status.
step() {
  local name="$1" seconds="$2"
  shift 2
  local rc=0
  timeout --kill-after=10 "$seconds" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
  tail -n 5 "$OUT_DIR/$name.log" | sed -e '$a\' -e "s/^/  $name: /" | tee -a "$SUMMARY"
  if [ "$rc" -eq 0 ]; then
    note "$name: ok"
  else
    [ "$rc" -eq 124 ] && note "$name: TIMED OUT after ${seconds}s" || note "$name: FAILED (rc=$rc)"
    status=1
  fi
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider tests/pallas_kernels)
step tests_fast 90 "${PYTEST[@]}" -m "not slow" --junitxml="$OUT_DIR/tests_fast.xml"
step tests_slow 110 "${PYTEST[@]}" -m slow --junitxml="$OUT_DIR/tests_slow.xml"
step kernel_bench 90 "$PY" scripts/kernel_bench.py --context_lens=32768 --batch=8 \
  --dtype=bfloat16 --output_json="$OUT_DIR/kernel_bench.json"
cat "$OUT_DIR/kernel_bench.log"
note "results in $OUT_DIR"
exit "$status"
