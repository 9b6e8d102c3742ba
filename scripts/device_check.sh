#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the Pallas kernel tests compiled on the GPU (not
# interpreted), then scripts/kernel_bench.py at 32k context, then the engine's decode step timed
# beside its predicted roofline (scripts/bench_roofline_predicted.py --measure), then the host
# link and host attention measured beside the simulated link model's figures
# (scripts/bench_host_attention.py --measure). Bounded to about 10 minutes. Without a GPU it
# stops at once, saying so.
#
#   scripts/device_check.sh            # from any directory
#
# Results go to $OUT, or ./device_results when OUT is unset: env.txt (GPU, versions),
# tests_fast.log/.xml, tests_slow.log/.xml, kernel_bench.log, kernel_bench.json,
# roofline.log, roofline_measured.json, link.log, link_measured.json, summary.txt.
# The exit status is non-zero if any step failed; every step runs regardless.
#
# Offline by design: it never touches the network. It runs the machine's own Python ($PYTHON,
# default python3), which must already import jax with a GPU backend, flax, absl, pytest and
# pytest-timeout (the lent H200 has jax 0.11.2 with the CUDA 13 plugin). The repo goes on
# PYTHONPATH (no install). kvjax imports that this Python lacks (gguf, ml_collections) travel as
# wheels in .whl/ (git-ignored; `scripts/fetch_device_wheels.sh` downloads them; carry `.whl`
# to the machine): they are installed with pip --no-index into $WHEEL_SITE (default
# /tmp/kvjax-site) and put on PYTHONPATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/device_results}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
WHEEL_SITE="${WHEEL_SITE:-/tmp/kvjax-site}"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

note() { echo "[device_check] $*" | tee -a "$SUMMARY"; }

# Fail fast: everything below needs an NVIDIA GPU.
if ! gpus="$(nvidia-smi -L 2>&1)" || ! grep -q '^GPU ' <<<"$gpus"; then
  note "FAILED: no NVIDIA GPU found (nvidia-smi -L: ${gpus:-no output}); this check needs one"
  exit 2
fi

shopt -s nullglob
wheels=("$ROOT"/.whl/*.whl)
if [ "${#wheels[@]}" -gt 0 ]; then
  note "installing ${#wheels[@]} carried wheel(s) from .whl into $WHEEL_SITE (no index)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WHEEL_SITE" "${wheels[@]}" >"$OUT_DIR/install.log" 2>&1 \
    || note "wheel install failed, see install.log"
fi
export PYTHONPATH="$ROOT:$ROOT/tests:$WHEEL_SITE${PYTHONPATH:+:$PYTHONPATH}"

# Every module the tests and the benchmark import, checked one by one so a miss is named.
missing=()
for module in jax flax absl pytest pytest_timeout hypothesis numpy yaml gguf kvjax \
    pallas_kernels; do
  "$PY" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
done
if [ "${#missing[@]}" -gt 0 ]; then
  note "FAILED: $PY cannot import: ${missing[*]} (pure-Python ones: add them to" \
    "scripts/fetch_device_wheels.sh and carry .whl)"
  "$PY" -c "import ${missing[0]}" >>"$SUMMARY" 2>&1 || true
  exit 1
fi
backend="$("$PY" -c 'import jax; print(jax.default_backend())' 2>>"$SUMMARY" || true)"
if [ "$backend" != "gpu" ]; then
  note "FAILED: jax's default backend is '$backend', not gpu"
  "$PY" -c 'import jax; print(jax.devices())' >>"$SUMMARY" 2>&1 || true
  exit 1
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__,
    "jaxlib", jaxlib.__version__); print(jax.devices())'
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

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/pallas_kernels)
step tests_fast 170 "${PYTEST[@]}" -m "not slow" --junitxml="$OUT_DIR/tests_fast.xml"
step tests_slow 100 "${PYTEST[@]}" -m slow --junitxml="$OUT_DIR/tests_slow.xml"
step kernel_bench 150 "$PY" scripts/kernel_bench.py --context_lens=32768 --batch=8 \
  --dtype=bfloat16 --output_json="$OUT_DIR/kernel_bench.json"
cat "$OUT_DIR/kernel_bench.log"
# The decode step measured on this GPU beside its prediction (published bandwidth and peak).
step roofline 120 env JAX_PLATFORMS=cuda "$PY" scripts/bench_roofline_predicted.py --measure \
  --shapes=smollm2,8b --kvs=exact,int8 --batches=32 --contexts=2048 \
  --output_json="$OUT_DIR/roofline_measured.json"
cat "$OUT_DIR/roofline.log"
# Host <-> device bandwidth (device_put to and from pinned_host) and host decode attention vs
# the device's, beside the simulated model's figures (the ECHO and host-rows benchmarks' link).
step link 60 "$PY" scripts/bench_host_attention.py --measure --measure_mib=256 \
  --output_json="$OUT_DIR/link_measured.json"
cat "$OUT_DIR/link.log"
note "results in $OUT_DIR"
exit "$status"
