#!/usr/bin/env bash
# Downloads the pure-Python wheels that kvjax imports but the lent GPU machine's Python lacks into
# .whl/ (git-ignored), so scripts/device_check.sh can install them there without a network.
#
#   scripts/fetch_device_wheels.sh          # run here, on a machine with PyPI access
#
# That machine has jax/jaxlib 0.11.2 (+ CUDA 13 plugin), flax (hence optax, PyYAML, msgpack,
# rich), absl-py, pytest, pytest-timeout, hypothesis, numpy, safetensors, tokenizers, orbax,
# matplotlib, tqdm and jinja2 for Python 3.12. `import kvjax` also needs gguf (kvjax.models
# loads GGUF files; its `requests` import is lazy), and kvjax.bench needs ml_collections.
# The versions are the ones this repo's .venv runs. Override the list with WHEELS="a==1 b==2".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-gguf==0.19.0 ml_collections==1.1.0}"
DEST="$ROOT/.whl"
mkdir -p "$DEST"
# shellcheck disable=SC2086  # WHEELS is a space-separated list of requirements.
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 -d "$DEST" $WHEELS
ls -l "$DEST"
du -sh "$DEST"
