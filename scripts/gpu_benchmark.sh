#!/usr/bin/env bash
# Regenerates the GPU benchmark report (`make gpu-benchmark-report`): builds the llama-1b benchmark model
# (TinyLlama 1.1B's dimensions, random bfloat16 weights, the 32000-token tokenizer trained locally), serves
# it with DTYPE=bfloat16 on the GPU and runs the benchmark in parts, each a run of its own (its REPORT.md
# and results.json, ratios against baselines measured in the same run) under its own time limit
# (GPU_BENCH_PART_S, default 420 s), so that one part fits a lent GPU's 10-minute command:
#   low       concurrency 1, 2, 4, 8 (128-token prompts, 128 new tokens, four requests per client), the
#             weights-bandwidth bound (a timed device copy), generate() eager at batch 1 and the raw
#             batched loop at 8, the torch-alone decode step at batch 1               -> OUT/low
#   high      concurrency 16 to 128, generate() eager and the raw batched loop at 128, the decode step
#             at 16 and 64                                                             -> OUT/high
#   compiled  concurrency 1 and 16 against generate() with a static cache compiled by torch.compile
#             (mode=reduce-overhead) at batch 1 and 16: most of its time is compiling  -> OUT/compiled
#   ttft      concurrency 16 with prompts of 128-512 tokens                            -> OUT/ttft-16
# GPU_BENCH_PARTS picks them (default all four, in turn); on a lent GPU run one per call, e.g.
#   GPU_BENCH_PARTS=low PYTHON=python3 bash scripts/gpu_benchmark.sh
# Building the model is a stage of its own (GPU_BENCH_BUILD_S, default 300 s; cached afterwards under
# TGIS_DEMO_CACHE: carry it). The plot needs matplotlib; without it the reports say so and the numbers
# are all in results.json.
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
# from the source tree (bench/ goes on PYTHONPATH; its tqdm must be among the wheels, matplotlib may be).
#
#   GPU_BENCH_QUICK=1    smoke run, on a CPU too: llama-tiny at concurrency 1 and 2, 4 requests each level,
#                        8 new tokens, the decode floor at batch 1 and 2; into build/gpu-benchmark-quick
#   GPU_BENCH_OUT=DIR    where the parts' directories go (default docs/benchmark/gpu)
#   GPU_BENCH_SHAPE=NAME the benchmark model's shape (default llama-1b; tgis-bench build-model --help lists them)
#   GPU_BENCH_ARGS=...   extra flags for every part's benchmark command
#   GPU_BENCH_SERVER_ENV="NAME=VALUE ..."  extra server settings (e.g. PT2_COMPILE=true)
#   DTYPE                the served dtype (default bfloat16)
#   PYTHON               the interpreter (default .venv/bin/python where it exists, else python3)
#   TGIS_DEMO_CACHE      where the model and tokenizer are built (default ~/.cache/tgis)
set -euo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
export PYTHON=$python

if [[ -z ${GPU_BENCH_ONE_PART:-} ]]; then
    # Each stage re-runs this script for one part, under its own time limit.
    if [[ "${GPU_BENCH_QUICK:-0}" != 0 ]]; then
        parts="quick"
    else
        parts=${GPU_BENCH_PARTS:-low high compiled ttft}
    fi
    stages="build $parts"
    budget=${GPU_BENCH_BUDGET_S:-86400}
    # shellcheck source=scripts/stage_lib.sh
    source scripts/stage_lib.sh
    stage build "${GPU_BENCH_BUILD_S:-300}" 30 env GPU_BENCH_ONE_PART=build bash "$0" || exit 1
    failed=0
    for part in $parts; do
        stage "$part" "${GPU_BENCH_PART_S:-420}" 60 env GPU_BENCH_ONE_PART="$part" bash "$0" || failed=1
    done
    echo "gpu_benchmark: parts $parts in $((SECONDS - stage_started)) s" >&2
    exit "$failed"
fi

dtype=${DTYPE:-bfloat16}
tgis=("$python" -m tgis)
export PYTHONPATH=$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
tgis_bench=("$python" -m tgis_bench)
part=$GPU_BENCH_ONE_PART
if [[ "${GPU_BENCH_QUICK:-0}" != 0 ]]; then
    shape=${GPU_BENCH_SHAPE:-llama-tiny}
else
    shape=${GPU_BENCH_SHAPE:-llama-1b}
fi
model_dir=$("${tgis_bench[@]}" build-model --shape "$shape")
if [[ $part == build ]]; then
    echo "The $shape benchmark model is in $model_dir" >&2
    exit 0
fi

out=${GPU_BENCH_OUT:-docs/benchmark/gpu}
top=128
workload=(--prompt-tokens 128:128 --new-tokens 128:128)
case $part in
quick)
    out=${GPU_BENCH_OUT:-build/gpu-benchmark-quick}
    top=2
    flags=(--requests 4 --concurrency 1,2 --prompt-tokens 32:32 --new-tokens 8:8 --decode-floor 1,2
        --decode-floor-prompt-tokens 32 --decode-floor-steps 8 --baselines sequential,batched)
    ;;
low)
    out=$out/low
    flags=(--requests 32 --requests-per-client 4 --concurrency 1,2,4,8 "${workload[@]}"
        --decode-floor 1 --decode-floor-prompt-tokens 128 --decode-floor-steps 64 --baselines sequential,batched)
    ;;
high)
    out=$out/high
    flags=(--requests 512 --requests-per-client 4 --concurrency 16,32,64,128 "${workload[@]}" --no-bound
        --decode-floor 16,64 --decode-floor-prompt-tokens 128 --decode-floor-steps 64
        --baselines batched,generate-batched)
    ;;
compiled)
    out=$out/compiled
    flags=(--requests 64 --requests-per-client 4 --concurrency 1,16 "${workload[@]}" --no-bound
        --baselines compiled,compiled-batched)
    ;;
ttft)
    out=$out/ttft-16
    flags=(--requests 64 --concurrency 16 --prompt-tokens 128:512 --new-tokens 128:128 --baselines none --no-bound)
    ;;
*)
    echo "unknown part $part (low, high, compiled, ttft, quick)" >&2
    exit 2
    ;;
esac

server_cmd=("${tgis[@]}" serve)
# Half the GPU's memory for the server's KV pool: the benchmark process loads the model again for the
# baselines while the server still runs.
read -r -a extra_env <<<"${GPU_BENCH_SERVER_ENV:-}"
server_env=(DTYPE="$dtype" MAX_BATCH_SIZE="$top" MAX_SEQUENCE_LENGTH=2048 MAX_NEW_TOKENS=512
    CUDA_PROCESS_MEMORY_FRACTION=0.5 ${extra_env[@]+"${extra_env[@]}"})
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports
start_server
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
"${tgis_bench[@]}" run --server "localhost:$grpc_port" --metrics-url "http://127.0.0.1:$http_port/metrics" \
    --model-dir "$model_dir" --dtype "$dtype" --no-progress --regenerate "make gpu-benchmark-report" \
    "${flags[@]}" --out "$out" ${GPU_BENCH_ARGS:-}
stop_server
