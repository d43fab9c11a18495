# Sourced by the speculation reports (speculation_report.sh, speculation_paired.sh) once they have set
# `python`: builds (once) the demo and benchmark models and the demo speculator, writes the demo
# model's held-out documents to `$heldout` (a prompt file no speculator was trained on), sets up
# serve_lib.sh to serve with MAX_BATCH_SIZE=16, and keeps a set of servers running side by side.
# Sets `tgis`, `tgis_bench` (run from bench/, put on PYTHONPATH), `demo_dir`, `bench_dir`, `scratch` (the
# caller removes it), `heldout`, `servers`, `logs`.
tgis=("$python" -m tgis)
export PYTHONPATH=$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
tgis_bench=("$python" -m tgis_bench)
demo_dir=$("${tgis[@]}" build-demo-model)
bench_dir=$("${tgis_bench[@]}" build-model --shape "${SPEC_BENCH_SHAPE:-gpt2-small}")
"$python" -c 'from tgis.demo_speculator import ensure_demo_speculator; ensure_demo_speculator()'
scratch=$(mktemp -d)
heldout=$scratch/demo-heldout-documents.txt
"$python" -c 'from tgis.demo_speculator import split_documents; print("\n".join(split_documents()[1]))' >"$heldout"

server_cmd=("${tgis[@]}" serve)
server_env=(MAX_BATCH_SIZE=16)
# shellcheck source=scripts/serve_lib.sh
source scripts/serve_lib.sh

servers=() logs=()

# keep_server: the server start_server just started joins the set, which stops together (or on exit).
keep_server() {
    servers+=("$server") logs+=("$log")
    trap stop_servers EXIT
}

stop_servers() {
    local i
    for i in "${!servers[@]}"; do
        server=${servers[$i]} log=${logs[$i]}
        stop_server
    done
    servers=() logs=()
}
