# Sourced by the GPU scripts (gpu_check.sh, gpu_benchmark.sh): run named stages, each under its own time
# limit and all of them within one budget, so that a lent device's 10-minute command never runs out
# with a stage half done and no word of why. The caller sets `budget` (seconds for the whole script)
# and `stages` (the names to run, space-separated); `stage` reads them.
#
# stage NAME LIMIT MINIMUM COMMAND...: runs COMMAND under `timeout` for LIMIT seconds, or for what is
# left of the budget if that is less; skips it (and says so) when fewer than MINIMUM seconds are left
# or NAME is not in `stages`. A stage that fails or overruns is reported and the next one runs.
# COMMAND may be a shell function: it runs in a child bash (export the variables it reads). At the limit
# `timeout` signals its whole process group, so servers a stage started in the background stop too.
# Returns COMMAND's status (0 when skipped).

stage_started=${stage_started:-$SECONDS}

stage_left() {
    echo $((budget - (SECONDS - stage_started)))
}

stage() {
    local name=$1 limit=$2 minimum=$3
    shift 3
    if [[ " ${stages} " != *" ${name} "* ]]; then
        return 0
    fi
    local left
    left=$(stage_left)
    ((limit > left)) && limit=$left
    if ((limit < minimum)); then
        echo "== ${name}: skipped, it would have ${limit} s (${left} s left of the ${budget} s budget) and needs" \
            "${minimum} s" >&2
        return 0
    fi
    echo "== ${name} (at most ${limit} s; $((SECONDS - stage_started)) s of ${budget} s used)" >&2
    local status=0
    if declare -F "$1" >/dev/null; then
        export -f "$1"
        timeout --kill-after=15 "$limit" bash -o pipefail -c '"$@"' "$name" "$@" || status=$?
    else
        timeout --kill-after=15 "$limit" "$@" || status=$?
    fi
    if ((status == 124 || status == 137)); then
        echo "== ${name}: stopped at its ${limit} s limit" >&2
    elif ((status != 0)); then
        echo "== ${name}: exit status ${status}" >&2
    fi
    return "$status"
}
