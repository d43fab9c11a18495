#!/usr/bin/env bash
# Regenerates the GPU benchmark report (`make gpu-benchmark-report`): builds the llama-1b benchmark model
# (TinyLlama 1.1B's dimensions, random bfloat16 weights, the 32000-token tokenizer trained locally), serves
# it with DTYPE=bfloat16 on the GPU, sweeps concurrency 1 to 128 with 128-token prompts and 128 new tokens,
# and in the same run measures the weights-bandwidth bound (a timed device copy), transformers' baselines
# (generate() eager and with a static cache + torch.compile mode=reduce-overhead, at batch 1 and 128, and
# the raw batched loop) and the torch-alone decode step at batch 1, 16 and 64; then a TTFT run at
# concurrency 16 with prompts of 128-512 tokens (into OUT/ttft-16). torch.compile takes much of its time
# (five compiled shapes); GPU_BENCH_ARGS="--baselines none" and GPU_BENCH_TTFT=0 make it a short run.
#
# On a GPU machine without a package registry (Python 3.12 with torch and transformers preinstalled), the
# project's other dependencies travel as wheels (../shared/tools/gpu-wheels.sh, whose header this follows):
#   here:  ../shared/tools/gpu-wheels.sh       # -> .whl/
#          .venv/bin/pip install -e .          # generates tgis/pb/*_pb2*.py (ignored files: carry tgis/pb)
#   there: site=$(mktemp -d)
#          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#              --target "$site" .whl/*.whl && export PYTHONPATH=$site:$PWD
#          PYTHON=python3 bash scripts/gpu_benchmark.sh
# This script installs nothing; it runs tgis as `$PYTHON -m tgis` and tgis-bench as `$PYTHON -m tgis_bench`
# from the source tree (bench/ goes on PYTHONPATH; its tqdm and matplotlib must be among the wheels).
#
#   GPU_BENCH_QUICK=1    smoke run, on a CPU too: llama-tiny at concurrency 1 and 2, 4 requests each level,
#                        8 new tokens, the decode floor at batch 1 and 2; into build/gpu-benchmark-quick
#   GPU_BENCH_OUT=DIR    where REPORT.md, results.json and throughput.png go (default docs/benchmark/gpu)
#   GPU_BENCH_SHAPE=NAME the benchmark model's shape (default llama-1b; tgis-bench build-model --help lists them)
#   GPU_BENCH_TTFT=0     skip the TTFT run
#   GPU_BENCH_ARGS=...   extra flags for both benchmark commands (e.g. "--baselines none")
#   GPU_BENCH_SERVER_ENV="NAME=VALUE ..."  extra server settings (e.g. PT2_COMPILE=true)
#   DTYPE                the served dtype (default bfloat16)
#   PYTHON               the interpreter (default .venv/bin/python where it exists, else python3)
#   TGIS_DEMO_CACHE      where the model and tokenizer are built (default ~/.cache/tgis)
set -euo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
dtype=${DTYPE:-bfloat16}
tgis=("$python" -m tgis)
export PYTHONPATH=$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
tgis_bench=("$python" -m tgis_bench)

if [[ "${GPU_BENCH_QUICK:-0}" != 0 ]]; then
    out=${GPU_BENCH_OUT:-build/gpu-benchmark-quick}
    shape=${GPU_BENCH_SHAPE:-llama-tiny}
    sweep=(--requests 4 --concurrency 1,2 --prompt-tokens 32:32 --new-tokens 8:8
        --decode-floor 1,2 --decode-floor-prompt-tokens 32 --decode-floor-steps 8)
    ttft=(--requests 4 --concurrency 2 --prompt-tokens 32:128 --new-tokens 8:8)
    ttft_dir=ttft
    top=2
else
    out=${GPU_BENCH_OUT:-docs/benchmark/gpu}
    shape=${GPU_BENCH_SHAPE:-llama-1b}
    # Four rounds per level: 4 requests at concurrency 1, 512 at 128 (so level 1 takes seconds, not minutes).
    sweep=(--requests 512 --requests-per-client 4 --concurrency 1,2,4,8,16,32,64,128
        --prompt-tokens 128:128 --new-tokens 128:128
        --decode-floor 1,16,64 --decode-floor-prompt-tokens 128 --decode-floor-steps 64)
    ttft=(--requests 64 --concurrency 16 --prompt-tokens 128:512 --new-tokens 128:128)
    ttft_dir=ttft-16
    top=128
fi

echo "Building (or reusing) the $shape benchmark model" >&2
model_dir=$("${tgis_bench[@]}" build-model --shape "$shape")

server_cmd=("${tgis[@]}" serve)
# Half the GPU's memory for the server's KV pool: the benchmark process loads the model again for the
# baselines while the server still runs.
read -r -a extra_env <<<"${GPU_BENCH_SERVER_ENV:-}"
server_env=(DTYPE="$dtype" MAX_BATCH_SIZE="$top" MAX_SEQUENCE_LENGTH=2048 MAX_NEW_TOKENS=512
    CUDA_PROCESS_MEMORY_FRACTION=0.5 ${extra_env[@]+"${extra_env[@]}"})
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports

# benchmark OUT_DIR FLAGS...: serve the model, run the benchmark with these flags, stop the server.
benchmark() {
    local out_dir=$1
    shift
    start_server
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
    "${tgis_bench[@]}" run --server "localhost:$grpc_port" --metrics-url "http://127.0.0.1:$http_port/metrics" \
        --model-dir "$model_dir" --dtype "$dtype" --no-progress --regenerate "make gpu-benchmark-report" \
        "$@" --out "$out_dir" ${GPU_BENCH_ARGS:-}
    stop_server
}

benchmark "$out" "${sweep[@]}" --baselines sequential,batched,generate-batched,compiled,compiled-batched
if [[ "${GPU_BENCH_TTFT:-1}" != 0 ]]; then
    benchmark "$out/$ttft_dir" "${ttft[@]}" --baselines none --no-bound
fi
