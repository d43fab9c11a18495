#!/usr/bin/env bash
# Regenerates the beam-search report (`make beam-report`): the benchmark model served in the CPU's
# default dtype, driven by `tgis-bench beams`: 4 beams against greedy decoding at 1 and 8 concurrent
# requests, in alternating rounds, beside transformers' own generate(num_beams=4).
#
#   BEAM_OUT=DIR     where the report goes (default docs/benchmark/beams): REPORT.md, results.json
#   BEAM_ARGS=...    more `tgis-bench beams` flags (e.g. "--rounds 5 --requests 32")
#   VENV=DIR         the virtual environment with tgis and tgis-bench installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
out=${BEAM_OUT:-docs/benchmark/beams}
python=$bin/python
model_dir=$("$bin/tgis-bench" build-model)
server_cmd=("$bin/text-generation-launcher")
server_env=(MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports
start_server
# shellcheck disable=SC2086
"$bin/tgis-bench" beams --url "http://127.0.0.1:$http_port" --model-dir "$model_dir" --width 4 \
    --concurrency 1,8 --out "$out" ${BEAM_ARGS:-}
stop_server
