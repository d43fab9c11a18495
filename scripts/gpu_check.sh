#!/usr/bin/env bash
# A lent GPU session's checks, in stages, each under its own time limit and all within GPU_CHECK_BUDGET_S
# (default 450 s, so that the whole script fits a device call's 10 minutes with room for its start):
#   setup        the carried wheels installed into a temporary site (when .whl/ holds any);
#   sdpa         SDPA's first call at new shapes, torch's default kernels against the server's
#                (scripts/gpu_sdpa_shapes.py), into OUT/sdpa-shapes.txt;
#   tests        the tests marked `gpu` (pytest -m gpu), log in OUT/gpu-tests.log; each test at most
#                GPU_CHECK_TEST_S seconds (default 120);
#   speculation  the speculation report (scripts/speculation_report.sh) for SPEC_MODELS (default demo):
#                off / prompt lookup / the MLP speculator at concurrency 1, 4 and 16, into
#                OUT/speculation.tar.gz. Not in the default stages: on an H200 the demo model's part
#                alone took about 330 s, so it runs as a call of its own:
#                  GPU_CHECK_STAGES="setup speculation" bash scripts/gpu_check.sh
#                  GPU_CHECK_STAGES="setup speculation" SPEC_MODELS=bench bash scripts/gpu_check.sh
# Prepare here (../shared/tools/gpu-wheels.sh's header): the wheels in .whl/, tgis/pb generated, and,
# optionally, the demo model and its speculator copied from the cache into .gpucache/ (so the GPU machine
# does not train them again). Carry .whl, tgis/pb and .gpucache; then, there: bash scripts/gpu_check.sh
#   GPU_CHECK_STAGES      the stages to run (default "setup sdpa tests")
#   GPU_CHECK_BUDGET_S    seconds for the whole script (default 450)
#   GPU_CHECK_SDPA_S / GPU_CHECK_TESTS_S / GPU_CHECK_SPEC_S   each stage's limit (defaults 60, 300, 420)
#   SPEC_ROUNDS           the speculation report's rounds (default 1 here: the device time is short)
# Nothing here needs matplotlib (the reports write no plot without it). Modules whose imports need a
# package the wheels leave out (text_generation, for the TGI REST tests) fail to collect there; the
# gpu-marked tests are collected and run all the same.
set -uo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-build/gpu-check}
budget=${GPU_CHECK_BUDGET_S:-450}
stages=${GPU_CHECK_STAGES:-setup sdpa tests}
mkdir -p "$out"
export python out # read by the stages, which run in child shells
# shellcheck source=scripts/stage_lib.sh
source scripts/stage_lib.sh

install_wheels() {
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/*.whl && echo "$site" >"$out/site-path"
}
rm -f "$out/site-path"
if compgen -G ".whl/*.whl" >/dev/null; then
    stage setup 120 10 install_wheels || exit 1
    if [[ -f $out/site-path ]]; then
        export PYTHONPATH=$(cat "$out/site-path"):$PWD
    fi
fi
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} # tgis, and tgis_bench beside it
if [[ -d .gpucache ]]; then
    export TGIS_DEMO_CACHE=$PWD/.gpucache
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 60 "$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

sdpa() {
    "$python" scripts/gpu_sdpa_shapes.py 2>&1 | tee "$out/sdpa-shapes.txt"
}
stage sdpa "${GPU_CHECK_SDPA_S:-60}" 20 sdpa

gpu_tests() {
    "$python" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
        -o timeout="${GPU_CHECK_TEST_S:-120}" tests bench/tests 2>&1 | tee "$out/gpu-tests.log" | tail -40
}
stage tests "${GPU_CHECK_TESTS_S:-300}" 60 gpu_tests

speculation() {
    local spec
    spec=$(mktemp -d)
    SERVER_LOGS=$spec/server-logs SPEC_OUT=$spec/speculation SPEC_ROUNDS="${SPEC_ROUNDS:-1}" PYTHON="$python" \
        SPEC_MODELS="${SPEC_MODELS:-demo}" SPEC_BENCH_SHAPE="${SPEC_BENCH_SHAPE:-llama-1b}" \
        bash scripts/speculation_report.sh >"$spec/speculation.log" 2>&1
    local status=$?
    tail -15 "$spec/speculation.log"
    tar -czf "$out/speculation.tar.gz" -C "$spec" .
    [[ -f $spec/speculation/REPORT.md ]] && cat "$spec/speculation/REPORT.md"
    return "$status"
}
stage speculation "${GPU_CHECK_SPEC_S:-420}" 120 speculation
echo "gpu_check: $((SECONDS - stage_started)) s of the ${budget} s budget" >&2
