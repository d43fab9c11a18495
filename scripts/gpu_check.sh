#!/usr/bin/env bash
# One lent GPU session's checks in one command, each stage under its own time limit so that one stage
# that hangs cannot take the others' time:
#   0. SDPA's first call at new shapes, torch's default kernels against the server's
#      (scripts/gpu_sdpa_shapes.py), into OUT/sdpa-shapes.txt;
#   1. the tests marked `gpu` (pytest -m gpu), log in OUT/gpu-tests.log;
#   2. the speculation report on the GPU (scripts/speculation_report.sh): the demo model off / prompt
#      lookup / its MLP speculator and the llama-1b benchmark model off / prompt lookup, concurrency 1, 4
#      and 16, input-grounded and mixed; the runs, their REPORT.md pages and the servers' logs in
#      OUT/speculation.tar.gz.
# Prepare here (../shared/tools/gpu-wheels.sh's header): the wheels in .whl/, tgis/pb generated, and,
# optionally, the demo model and its speculator copied from the cache into .gpucache/ (so the GPU machine
# does not train them again). Carry .whl, tgis/pb and .gpucache; then, there:
#   bash scripts/gpu_check.sh
#   GPU_CHECK_TESTS_S / GPU_CHECK_SPEC_S   each stage's limit in seconds (defaults 180 and 300; on an H200
#                                          the demo model's part of the report alone took about 330 s)
#   SPEC_ROUNDS                            the report's rounds (default 1 here: the device time is short)
# Modules whose imports need a package the wheels leave out (text_generation, for the TGI REST tests)
# fail to collect there; the gpu-marked tests are collected and run all the same.
set -uo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-build/gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/*.whl || exit 1
    export PYTHONPATH=$site:$PWD
fi
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}  # tgis, and tgis_bench beside it
if [[ -d .gpucache ]]; then
    export TGIS_DEMO_CACHE=$PWD/.gpucache
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

echo "== SDPA at new shapes" >&2
timeout 90 "$python" scripts/gpu_sdpa_shapes.py 2>&1 | tee "$out/sdpa-shapes.txt"

echo "== tests marked gpu" >&2
timeout "${GPU_CHECK_TESTS_S:-180}" "$python" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests bench/tests 2>&1 |
    tee "$out/gpu-tests.log" | tail -25

echo "== speculation report" >&2
spec=$(mktemp -d)
SERVER_LOGS=$spec/server-logs SPEC_OUT=$spec/speculation SPEC_ROUNDS="${SPEC_ROUNDS:-1}" PYTHON="$python" SPEC_BENCH_SHAPE="${SPEC_BENCH_SHAPE:-llama-1b}" \
    timeout "${GPU_CHECK_SPEC_S:-300}" bash scripts/speculation_report.sh >"$spec/speculation.log" 2>&1
echo "speculation report exit $?"
tail -15 "$spec/speculation.log"
tar -czf "$out/speculation.tar.gz" -C "$spec" .
if [[ -f $spec/speculation/REPORT.md ]]; then
    cat "$spec/speculation/REPORT.md"
fi
