#!/usr/bin/env bash
# Regenerates the quantization report (`make quantization-report`, docs/benchmark/quantization/):
#   1. speed: the benchmark model (GPT-2-small shape) served in float32, the CPU's default dtype, int8
#      and int4, each at concurrency 1 and 32 (64-token prompts, 64 new tokens, greedy, streamed),
#      beside llama.cpp's server on the GGUF of each format (f32, bf16, q8_0, q4_0, Q4_K_M) and against
#      the machine's read bandwidth (the benchmark's bound);
#   2. the long-prompt mix in each format: 16 streams, every 4th request a prompt of 400 words;
#   3. quality: the trained demo model in each format, teacher-forced through the servers on its own
#      corpus (`tgis-bench quality`): perplexity and top-1 agreement with the default dtype.
#
#   QUANT_OUT=DIR           where the runs go (default docs/benchmark/quantization)
#   LLAMACPP_SERVER=BIN     a llama-server binary built for this machine (docs/benchmarking.md), with
#   LLAMACPP_GGUF_DIR=DIR   the GGUF conversions of the benchmark model: NAME-{f32,bf16,q8_0,q4_0,q4_k_m}.gguf
#   QUANT_PARTS="speed long quality"  which parts to run
#   QUANT_FORMATS="default float32 int8 int4"  which formats (default: all four)
#   QUANT_SERVER_ENV="PT2_COMPILE=true"  more settings for every tgis server (e.g. compiled)
#   QUANT_CONCURRENCY=1,32  the speed part's concurrency levels
#   VENV=DIR                the virtual environment with tgis and tgis-bench installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
out=${QUANT_OUT:-docs/benchmark/quantization}
parts=${QUANT_PARTS:-speed long quality}
python=$bin/python
default_dtype=$("$python" -c 'from tgis_bench.load.cli import default_dtype; print(default_dtype())')
server_cmd=("$bin/text-generation-launcher")
# shellcheck disable=SC2206 # QUANT_SERVER_ENV is a list of NAME=VALUE words
server_env=(MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128 ${QUANT_SERVER_ENV:-})
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh

# shellcheck source=scripts/quantization_formats.sh
source scripts/quantization_formats.sh
peers_for() {
    peers=()
    [[ -z "${LLAMACPP_SERVER:-}" ]] && return
    peers+=(--llamacpp-server "$LLAMACPP_SERVER")
    local gguf=${LLAMACPP_GGUF_DIR:?LLAMACPP_GGUF_DIR must name the directory of the GGUF conversions}
    for type in $(format_ggufs "$1"); do
        peers+=(--llamacpp-gguf "$gguf/$(basename "$model_dir")-$type.gguf")
    done
}

formats=(default float32 int8 int4)
[[ $default_dtype == float32 ]] && formats=(float32 int8 int4)
# shellcheck disable=SC2206 # a list of format names
[[ -n ${QUANT_FORMATS:-} ]] && formats=($QUANT_FORMATS)
check_formats "${formats[@]}"

if [[ " $parts " == *" speed "* ]]; then
    model_dir=$("$bin/tgis-bench" build-model)
    pick_ports
    for format in "${formats[@]}"; do
        peers_for "$format"
        start_server $(format_settings "$format")
        "$bin/tgis-bench" run --server "localhost:$grpc_port" \
            --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" \
            --requests 32 --concurrency "${QUANT_CONCURRENCY:-1,32}" --prompt-tokens 64:64 --new-tokens 64:64 --baselines none \
            ${peers[@]+"${peers[@]}"} --regenerate "QUANT_PARTS=speed make quantization-report" \
            --out "$out/speed-$format"
        stop_server
    done
fi
if [[ " $parts " == *" long "* ]]; then
    model_dir=$("$bin/tgis-bench" build-model)
    pick_ports
    for format in "${formats[@]}"; do
        start_server $(format_settings "$format")
        "$bin/tgis-bench" run --server "localhost:$grpc_port" \
            --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" \
            --requests 64 --concurrency 16 --prompt-tokens 16:128 --new-tokens 48:48 \
            --long-prompt-every 4 --long-prompt-words 400 --baselines none --no-bound \
            --regenerate "QUANT_PARTS=long make quantization-report" --out "$out/long-prompts-$format"
        stop_server
    done
fi
if [[ " $parts " == *" quality "* ]]; then
    model_dir=$("$bin/text-generation-server" build-demo-model)
    servers=()
    pids=()
    for format in "${formats[@]}"; do  # the baseline first: the CPU's default dtype
        [[ $format == float32 && $default_dtype != float32 ]] && continue
        pick_ports
        start_server $(format_settings "$format")
        pids+=("$server")
        servers+=(--server "$format=localhost:$grpc_port")
        server=""  # kept running: every quality server answers the same windows
    done
    if [[ $default_dtype != float32 ]]; then
        pick_ports
        start_server DTYPE=float32
        pids+=("$server")
        servers+=(--server "float32=localhost:$grpc_port")
        server=""
    fi
    "$bin/tgis-bench" quality ${servers[@]+"${servers[@]}"} --model-dir "$model_dir" --out "$out/quality"
    kill -TERM "${pids[@]}" && wait "${pids[@]}" || true
fi
