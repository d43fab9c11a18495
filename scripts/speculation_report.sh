#!/usr/bin/env bash
# Regenerates the speculation report (`make speculation-report`): the demo model served with speculation
# off, with prompt lookup (SPECULATOR_NAME=ngram) and with the demo MLP speculator (SPECULATOR_NAME=demo),
# each driven with the same two workloads at concurrency 1, 4 and 16:
#   - input-grounded: windows of the demo text's held-out documents (unseen by the speculator), each
#     ending with its first fifth again, so that the model copies spans of its prompt;
#   - mixed: the benchmark's usual seeded filler text.
# Every run keeps its own REPORT.md and results.json; REPORT.md at the top sets them side by side.
#
#   SPEC_OUT=DIR   where the runs go (default docs/benchmark/speculation)
#   VENV=DIR       the virtual environment with tgis installed (default .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
out=${SPEC_OUT:-docs/benchmark/speculation}
python=$bin/python
model_dir=$("$bin/text-generation-server" build-demo-model)
"$python" -c 'from tgis.demo_speculator import ensure_demo_speculator; ensure_demo_speculator()'
mkdir -p "$out"
scratch=$(mktemp -d)
heldout=$scratch/demo-heldout-documents.txt
"$python" -c 'from tgis.demo_speculator import split_documents; print("\n".join(split_documents()[1]))' >"$heldout"
# The demo model's context is 128 positions: prompts and answers fit in it.
common=(--requests 64 --concurrency 1,4,16 --prompt-tokens 24:64 --new-tokens 32:64 --baselines none)
declare -A workload_flags=(
    [grounded]="--grounded --prompt-text $heldout"
    [mixed]=""
)

server_cmd=("$bin/text-generation-launcher")
server_env=(MAX_BATCH_SIZE=16)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh
pick_ports

for speculator in off ngram demo; do
    settings=()
    [[ $speculator != off ]] && settings=(SPECULATOR_NAME="$speculator")
    start_server ${settings[@]+"${settings[@]}"}
    for workload in grounded mixed; do
        # shellcheck disable=SC2086  # the flags split into words on purpose
        "$bin/text-generation-server" benchmark --server "localhost:$grpc_port" \
            --metrics-url "http://127.0.0.1:$http_port/metrics" --model-dir "$model_dir" \
            "${common[@]}" ${workload_flags[$workload]} --regenerate "make speculation-report" \
            --no-progress --out "$out/$workload-$speculator"
    done
    stop_server
done
rm -rf "$scratch"

report=$out/REPORT.md
cat >"$report" <<'HEADER'
# Speculative decoding: off against on, same workloads, same session

`make speculation-report` regenerates this page. Each column is a run of its own (its directory holds
REPORT.md and results.json); ratios are tokens/s against speculation off at the same concurrency. Acceptance
is the share of draft tokens the model accepted; tokens/step what a speculating sequence gained per step.

HEADER
for workload in grounded mixed; do
    "$bin/text-generation-server" compare-runs --baseline "off=$out/$workload-off" \
        --run "ngram=$out/$workload-ngram" --run "mlp=$out/$workload-demo" \
        --title "Workload: $workload" --out "$report"
done
echo "Wrote $report"
