#!/usr/bin/env bash
# One stream, in paired rounds: tgis under PT2_COMPILE=true in int8 and in the CPU's default dtype (or
# the formats PAIRED_FORMATS names), each round's tgis run followed at once by llama.cpp's server on the
# matching GGUF (Q8_0, Q4_0 for int4, BF16 or F32 for the default dtype, F32 for float32), so that each
# ratio compares runs made within the same minute (docs/benchmark/quantization/). The tgis servers start
# first (their warm-up compiles for minutes) and stay up, idle between turns.
#
#   LLAMACPP_SERVER=BIN     a llama-server binary built for this machine (docs/benchmarking.md)
#   LLAMACPP_GGUF_DIR=DIR   the benchmark model's GGUF conversions: NAME-{q8_0,q4_0,bf16,f32}.gguf
#   PAIRED_FORMATS="int8 default"  the tgis formats: int8, int4, default, float32
#   PAIRED_ROUNDS=3         rounds; PAIRED_REQUESTS=24 requests a run (64-token prompts, 64 new tokens)
#   PAIRED_OUT=DIR          where the runs go (default docs/benchmark/quantization/kernels-paired)
#   VENV=DIR                the virtual environment with tgis and tgis-bench installed (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
python=$bin/python
out=${PAIRED_OUT:-docs/benchmark/quantization/kernels-paired}
llamacpp=${LLAMACPP_SERVER:?LLAMACPP_SERVER must name a llama-server binary}
gguf_dir=${LLAMACPP_GGUF_DIR:?LLAMACPP_GGUF_DIR must name the directory of the GGUF conversions}
default_dtype=$("$python" -c 'from tgis_bench.load.cli import default_dtype; print(default_dtype())')
server_cmd=("$bin/text-generation-launcher")
server_env=(MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128 PT2_COMPILE=true)
model_dir=$("$bin/tgis-bench" build-model)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh

# shellcheck source=scripts/quantization_formats.sh
source scripts/quantization_formats.sh

declare -A grpc_of http_of
# shellcheck disable=SC2206 # a list of format names
formats=(${PAIRED_FORMATS:-int8 default})
servers=()
check_formats "${formats[@]}"
for format in "${formats[@]}"; do
    pick_ports
    start_server "$(format_settings "$format")"
    servers+=("$server")
    grpc_of[$format]=$grpc_port
    http_of[$format]=$http_port
    server=""  # kept running for every round
done
trap 'kill -TERM "${servers[@]}" 2>/dev/null; wait "${servers[@]}" 2>/dev/null || true' EXIT
for round in $(seq "${PAIRED_ROUNDS:-3}"); do
    for format in "${formats[@]}"; do
        "$bin/tgis-bench" run --server "localhost:${grpc_of[$format]}" \
            --metrics-url "http://127.0.0.1:${http_of[$format]}/metrics" --model-dir "$model_dir" \
            --requests "${PAIRED_REQUESTS:-24}" --concurrency 1 --prompt-tokens 64:64 --new-tokens 64:64 \
            --baselines none --llamacpp-server "$llamacpp" \
            --llamacpp-gguf "$gguf_dir/$(basename "$model_dir")-$(format_ggufs "$format" | cut -d' ' -f1).gguf" \
            --regenerate "bash scripts/quantization_paired.sh" --out "$out/$format-round$round"
    done
done
