#!/usr/bin/env bash
# Regenerates the single-stream report (`make single-stream-report`): the benchmark model served in
# float32 and in the CPU's default dtype, each measured at concurrency 1, 2, 4 and 32 on the mixed
# workload beside llama.cpp's server on the GGUF of the same dtype (and q8_0 beside the default run),
# then `tgis-bench profile-step` splitting a lone stream's decode step by operator.
#
#   SINGLE_OUT=DIR          where the runs go (default docs/benchmark/single-stream): DIR/float32 and
#                           DIR/default, each with REPORT.md, results.json and step-profile.md
#   LLAMACPP_SERVER=BIN     a llama-server binary built for this machine, and/or
#   LLAMACPP_PYTHON=PY      a Python with xllamacpp installed, with
#   LLAMACPP_GGUF_DIR=DIR   the GGUF conversions of the benchmark model (docs/benchmarking.md)
#   SINGLE_PT2=1            also float32 with PT2_COMPILE=true (into DIR/float32-pt2-compile; the server
#                           compiles for minutes before it serves)
#   SINGLE_LONG=1           also float32 with 512-token prompts and 64 new tokens at concurrency 1, 2 and 4
#                           (into DIR/long-prompts-float32), where attention over the context weighs more
#   VENV=DIR                the virtual environment with tgis and tgis-bench installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
out=${SINGLE_OUT:-docs/benchmark/single-stream}
python=$bin/python
model_dir=$("$bin/tgis-bench" build-model)
default_dtype=$("$python" -c 'from tgis_bench.load.cli import default_dtype; print(default_dtype())')
workload=(--requests 64 --concurrency 1,2,4,32 --prompt-tokens 16:128 --new-tokens 32:96 --baselines none)

# llama_peers TYPE...: the peer flags for the GGUF conversions of these types, if a llama.cpp is given.
llama_peers() {
    peers=()
    [[ -n "${LLAMACPP_SERVER:-}" ]] && peers+=(--llamacpp-server "$LLAMACPP_SERVER")
    [[ -n "${LLAMACPP_PYTHON:-}" ]] && peers+=(--llamacpp-python "$LLAMACPP_PYTHON")
    [[ ${#peers[@]} -eq 0 ]] && return
    local gguf=${LLAMACPP_GGUF_DIR:?LLAMACPP_GGUF_DIR must name the directory of the GGUF conversions}
    gguf=$gguf/$(basename "$model_dir")
    for type in "$@"; do
        peers+=(--llamacpp-gguf "$gguf-$type.gguf")
    done
}

server_cmd=("$bin/text-generation-launcher")
server_env=(MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports

for dtype in float32 "$default_dtype"; do
    dir=$out/$([[ $dtype == float32 ]] && echo float32 || echo default)
    [[ $dtype == float32 ]] && llama_peers f32 || llama_peers bf16 q8_0
    mkdir -p "$dir"
    start_server DTYPE="$dtype"
    "$bin/tgis-bench" run --server "localhost:$grpc_port" \
        --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" --dtype "$dtype" \
        "${workload[@]}" ${peers[@]+"${peers[@]}"} --regenerate "make single-stream-report" --out "$dir"
    stop_server
    "$bin/tgis-bench" profile-step --model-dir "$model_dir" --dtype "$dtype" --out "$dir/step-profile.md"
    [[ $dtype == "$default_dtype" ]] && break  # float32 is this CPU's default: one run covers both
done
if [[ "${SINGLE_PT2:-0}" != 0 ]]; then
    dir=$out/float32-pt2-compile
    llama_peers f32
    mkdir -p "$dir"
    start_server DTYPE=float32 PT2_COMPILE=true
    "$bin/tgis-bench" run --server "localhost:$grpc_port" \
        --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" --dtype float32 \
        "${workload[@]}" ${peers[@]+"${peers[@]}"} --regenerate "SINGLE_PT2=1 make single-stream-report" \
        --out "$dir"
    stop_server
fi
if [[ "${SINGLE_LONG:-0}" != 0 ]]; then
    dir=$out/long-prompts-float32
    llama_peers f32
    mkdir -p "$dir"
    start_server DTYPE=float32
    "$bin/tgis-bench" run --server "localhost:$grpc_port" \
        --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" --dtype float32 \
        --requests 12 --concurrency 1,2,4 --prompt-tokens 512:512 --new-tokens 64:64 --baselines none \
        ${peers[@]+"${peers[@]}"} --regenerate "SINGLE_LONG=1 make single-stream-report" --out "$dir"
    stop_server
fi
