#!/usr/bin/env bash
# Task A, gated: three servers (before, before-again: a14ce3a; after: a5e24f3), each from its own worktree;
# CALLS calls of `tgis-bench paired-runs --rounds 2` (A B C then C B A), each with its own seed (fresh
# prompts, no prefix-cache hits across calls), each started only once the machine has been idle for 5 s.
#   BEFORE=DIR AFTER=DIR  the two worktrees (each with the generated tgis/pb stubs copied in)
#   VENV=DIR              the venv with tgis-bench (default .venv); OUT=DIR where the calls go
set -euo pipefail
py=${VENV:-.venv}/bin/python
bench=${VENV:-.venv}/bin/tgis-bench
model_dir=$($bench build-model)
out=${OUT:-refactor43}
mkdir -p $out
$py "$(dirname "$0")/monitor.py" $$ $out/foreign-cpu.log &
pids=()
targets=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
serve() {  # NAME TREE
    local name=$1 tree=$2
    read -r gp hp < <($py -c '
import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*(x.getsockname()[1] for x in s))')
    (cd "$out" && exec env PYTHONPATH=$tree MAX_BATCH_SIZE=32 MAX_SEQUENCE_LENGTH=1024 MAX_NEW_TOKENS=128 \
        MODEL_NAME=$model_dir GRPC_PORT=$gp PORT=$hp $py -c '
import sys, tgis, engines
print("tgis from", tgis.__file__, "engines from", engines.__file__, flush=True)
from tgis.cli import launcher_main
sys.argv[0] = "text-generation-launcher"
launcher_main()' >$out/server-$name.log 2>&1) &
    pids+=($!)
    until $py -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "http://127.0.0.1:$hp/health" 2>/dev/null; do
        kill -0 "${pids[-1]}" || { cat $out/server-$name.log; exit 1; }
        sleep 1
    done
    head -1 $out/server-$name.log
    targets+=(--server "$name=localhost:$gp,http://127.0.0.1:$hp/metrics")
}
serve before "${BEFORE:?BEFORE must name the worktree at a14ce3a}"
serve before-again "$BEFORE"
serve after "${AFTER:?AFTER must name the worktree at a5e24f3}"
idle() {  # the machine under 10 % of a core busy for 5 s running
    $py - <<'PY'
import psutil, time
ok = 0
while ok < 5:
    ok = ok + 1 if psutil.cpu_percent(interval=1) < 5 else 0   # of both cores: 5 % = a tenth of one
PY
}
# Calls until CLEAN of them ran with no foreign CPU (over 20 % of a core in any second of the monitor's
# log), at most MAX calls or DEADLINE seconds; the contaminated ones are kept and marked.
clean=0; i=0; started=$SECONDS
while (( clean < ${CLEAN:-6} && i < ${MAX:-30} && SECONDS - started < ${DEADLINE:-3000} )); do
    i=$((i + 1))
    idle
    t0=$(date +%s.%N)
    $bench paired-runs "${targets[@]}" --model-dir "$model_dir" --rounds 2 --seed $((100 + i)) \
        --requests 64 --concurrency 32 --prompt-tokens 16:128 --new-tokens 32:96 \
        --title "Issue 43: before (a14ce3a) vs after (a5e24f3), concurrency 32, call $i" --out $out/call-$i \
        > $out/call-$i.log 2>&1
    t1=$(date +%s.%N)
    sleep 1.5
    peak=$(awk -v a=$t0 -v b=$t1 '$1>=a && $1<=b+1 && $2>m {m=$2} END {print m+0}' $out/foreign-cpu.log)
    verdict=clean; (( peak > 20 )) && verdict=contaminated || clean=$((clean + 1))
    echo "call $i start $t0 end $t1 foreign_peak_pct $peak $verdict" | tee -a $out/calls.log
done
