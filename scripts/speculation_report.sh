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
# model's is. A model's configurations are served side by side and driven in turn, SPEC_ROUNDS times,
# so that each round compares them in the same minute of a machine whose speed drifts; every run keeps
# its own REPORT.md and results.json (NAME-WORKLOAD-SPECULATOR/round-N/), and REPORT.md at the top sets
# them side by side: medians over the rounds, each round's ratio against the same round's baseline.
#
#   SPEC_OUT=DIR          where the runs go (default docs/benchmark/speculation)
#   VENV=DIR              the virtual environment with tgis and tgis-bench installed (default .venv)
#   PYTHON=python3        instead of VENV: an interpreter that runs tgis from this source tree
#                         (`python -m tgis`; a GPU machine with carried wheels, as scripts/gpu_check.sh runs it)
#   SPEC_BENCH_SHAPE=NAME the benchmark model's shape (default gpt2-small; llama-1b on a GPU)
#   SPEC_ROUNDS=N         rounds of every configuration in turn (default 3)
#   SPEC_MODELS="demo bench"  the models to measure (default both; one at a time fits a lent GPU's
#                         10-minute command: scripts/gpu_check.sh's speculation stages)
set -euo pipefail

cd "$(dirname "$0")/.."
out=${SPEC_OUT:-docs/benchmark/speculation}
python=${PYTHON:-${VENV:-.venv}/bin/python}
mkdir -p "$out"
# shellcheck source=scripts/speculation_lib.sh
source scripts/speculation_lib.sh

rounds=${SPEC_ROUNDS:-3}
models=${SPEC_MODELS:-demo bench}

# measure NAME MODEL_DIR "BENCHMARK FLAGS" "GROUNDED FLAGS" SPECULATOR...: each speculator (off: none)
# served at once, then SPEC_ROUNDS rounds of both workloads driven against each in turn, into
# $out/NAME-WORKLOAD-SPECULATOR/round-N.
measure() {
    local name=$1 dir=$2 flags=$3 grounded=$4
    shift 4
    model_dir=$dir
    local speculator workload round i extra settings grpc_ports=() http_ports=()
    for speculator in "$@"; do
        settings=()
        [[ $speculator != off ]] && settings=(SPECULATOR_NAME="$speculator")
        pick_ports
        start_server ${settings[@]+"${settings[@]}"}
        keep_server
        grpc_ports+=("$grpc_port") http_ports+=("$http_port")
        for workload in grounded mixed; do
            rm -rf "$out/$name-$workload-$speculator"
        done
    done
    for ((round = 1; round <= rounds; round++)); do
        for workload in grounded mixed; do
            extra=""
            [[ $workload == grounded ]] && extra=$grounded
            i=0
            for speculator in "$@"; do
                # shellcheck disable=SC2086  # the flags split into words on purpose
                "${tgis_bench[@]}" run --server "localhost:${grpc_ports[$i]}" \
                    --metrics-url "http://127.0.0.1:${http_ports[$i]}/metrics" --model-dir "$model_dir" \
                    --concurrency 1,4,16 --baselines none $flags $extra --no-progress \
                    --regenerate "make speculation-report" --out "$out/$name-$workload-$speculator/round-$round"
                i=$((i + 1))
            done
        done
    done
    stop_servers
}

# The demo model's context is 128 positions: prompts and answers fit in it.
if [[ " $models " == *" demo "* ]]; then
    measure demo "$demo_dir" "--requests 64 --prompt-tokens 24:64 --new-tokens 32:64" \
        "--grounded --prompt-text $heldout" off ngram demo
fi
# Every level drives all 32 requests: with only the first four at concurrency 1, the grounded answers
# of those four looped less than the rest (57 % acceptance against 71 % over all 32).
if [[ " $models " == *" bench "* ]]; then
    measure bench "$bench_dir" "--requests 32 --prompt-tokens 64:128 --new-tokens 64:96" \
        "--grounded" off ngram
fi
rm -rf "$scratch"

report=$out/REPORT.md
cat >"$report" <<'HEADER'
# Speculative decoding: off against on, same workloads, same session

`make speculation-report` regenerates this page. A model's configurations were served side by side and
driven in turn, round after round; each round of each is a run of its own (its directory holds
REPORT.md and results.json). A cell is the median over the rounds; a ratio is the median of each
round's tokens/s against speculation off in the same round at the same concurrency, with the range of
those ratios. Acceptance is the share of draft tokens the model accepted; tokens/step what a
speculating sequence gained per step. The demo model (2 layers, hidden 128) is too small for its step
to be bound by reading its weights: per-token work (sampling each verified position, detokenizing,
streaming) is most of its step, so speculation saves less there than on a real model. The benchmark
model (GPT-2-small's shape, random weights) is bound by its weights as real models are; prompt lookup
is the only proposer it has.

HEADER
# rounds_of DIR: DIR/round-1,DIR/round-2,... as compare-runs takes a configuration's rounds.
rounds_of() {
    local round list=""
    for ((round = 1; round <= rounds; round++)); do
        list+="${list:+,}$1/round-$round"
    done
    echo "$list"
}

for model in $models; do
    for workload in grounded mixed; do
        runs=(--run "ngram=$(rounds_of "$out/$model-$workload-ngram")")
        [[ $model == demo ]] && runs+=(--run "mlp=$(rounds_of "$out/$model-$workload-demo")")
        "${tgis_bench[@]}" compare-runs --baseline "off=$(rounds_of "$out/$model-$workload-off")" "${runs[@]}" \
            --title "$model model, $workload workload" --out "$report"
    done
done
echo "Wrote $report"
