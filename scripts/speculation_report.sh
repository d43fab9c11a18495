#!/usr/bin/env bash
# Regenerates the speculation report (`make speculation-report`): speculation off against on, same
# workloads, same session, at concurrency 1, 4 and 16, on two workloads:
#   - input-grounded: windows of text each ending with its first fifth again, so that a model that
#     follows its input copies spans of its prompt (for the demo model: its held-out documents, unseen
#     by the demo speculator);
#   - mixed: the benchmark's usual seeded filler text.
# Two models: the demo model, off / prompt lookup (SPECULATOR_NAME=ngram) / its MLP speculator
# (SPECULATOR_NAME=demo); and the GPT-2-small-shaped benchmark model (random weights, so no speculator
# can be trained for it), off / prompt lookup, where a step is bound by reading the weights as a real
# model's is. Every run keeps its own REPORT.md and results.json; REPORT.md at the top sets them side
# by side.
#
#   SPEC_OUT=DIR          where the runs go (default docs/benchmark/speculation)
#   VENV=DIR              the virtual environment with tgis installed (default .venv)
#   PYTHON=python3        instead of VENV: an interpreter that runs tgis from this source tree
#                         (`python -m tgis`; a GPU machine with carried wheels, as scripts/gpu_check.sh runs it)
#   SPEC_BENCH_SHAPE=NAME the benchmark model's shape (default gpt2-small; llama-1b on a GPU)
set -euo pipefail

cd "$(dirname "$0")/.."
out=${SPEC_OUT:-docs/benchmark/speculation}
python=${PYTHON:-${VENV:-.venv}/bin/python}
tgis=("$python" -m tgis)
demo_dir=$("${tgis[@]}" build-demo-model)
bench_dir=$("${tgis[@]}" build-bench-model --shape "${SPEC_BENCH_SHAPE:-gpt2-small}")
"$python" -c 'from tgis.demo_speculator import ensure_demo_speculator; ensure_demo_speculator()'
mkdir -p "$out"
scratch=$(mktemp -d)
heldout=$scratch/demo-heldout-documents.txt
"$python" -c 'from tgis.demo_speculator import split_documents; print("\n".join(split_documents()[1]))' >"$heldout"

server_cmd=("${tgis[@]}" serve)
server_env=(MAX_BATCH_SIZE=16)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports

# measure NAME MODEL_DIR "BENCHMARK FLAGS" "GROUNDED FLAGS" SPECULATOR...: each speculator (off: none)
# served once, both workloads driven against it, into $out/NAME-WORKLOAD-SPECULATOR.
measure() {
    local name=$1 dir=$2 flags=$3 grounded=$4
    shift 4
    model_dir=$dir
    for speculator in "$@"; do
        settings=()
        [[ $speculator != off ]] && settings=(SPECULATOR_NAME="$speculator")
        start_server ${settings[@]+"${settings[@]}"}
        for workload in grounded mixed; do
            extra=""
            [[ $workload == grounded ]] && extra=$grounded
            # shellcheck disable=SC2086  # the flags split into words on purpose
            "${tgis[@]}" benchmark --server "localhost:$grpc_port" \
                --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" \
                --concurrency 1,4,16 --baselines none $flags $extra --no-progress \
                --regenerate "make speculation-report" --out "$out/$name-$workload-$speculator"
        done
        stop_server
    done
}

# The demo model's context is 128 positions: prompts and answers fit in it.
measure demo "$demo_dir" "--requests 64 --prompt-tokens 24:64 --new-tokens 32:64" \
    "--grounded --prompt-text $heldout" off ngram demo
measure bench "$bench_dir" "--requests 32 --requests-per-client 4 --prompt-tokens 64:128 --new-tokens 64:96" \
    "--grounded" off ngram
rm -rf "$scratch"

report=$out/REPORT.md
cat >"$report" <<'HEADER'
# Speculative decoding: off against on, same workloads, same session

`make speculation-report` regenerates this page. Each column is a run of its own (its directory holds
REPORT.md and results.json); ratios are tokens/s against speculation off at the same concurrency.
Acceptance is the share of draft tokens the model accepted; tokens/step what a speculating sequence
gained per step. The demo model (2 layers, hidden 128) is too small for its step to be bound by reading
its weights: per-token work (sampling each verified position, detokenizing, streaming) is most of its
step, so speculation saves less there than on a real model. The benchmark model (GPT-2-small's shape,
random weights) is bound by its weights as real models are; prompt lookup is the only proposer it has.

HEADER
for model in demo bench; do
    for workload in grounded mixed; do
        runs=(--run "ngram=$out/$model-$workload-ngram")
        [[ $model == demo ]] && runs+=(--run "mlp=$out/$model-$workload-demo")
        "${tgis[@]}" compare-runs --baseline "off=$out/$model-$workload-off" "${runs[@]}" \
            --title "$model model, $workload workload" --out "$report"
    done
done
echo "Wrote $report"
