# Sourced by the report scripts (benchmark_report.sh, gpu_benchmark.sh): start a tgis server on two free
# ports, wait until it answers /health, stop it. The caller sets `python` (an interpreter that imports
# tgis), `server_cmd` (an array: the command that serves, e.g. text-generation-launcher or
# "$python -m tgis serve") and `model_dir`; these functions set `server`, `log`, `grpc_port`, `http_port`.

# pick_ports: two distinct free ports, held together while chosen.
pick_ports() {
    read -r grpc_port http_port < <("$python" -c '
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))
')
}

# start_server [NAME=VALUE...]: serves $model_dir with these settings (after the caller's defaults in
# `server_env`), output to a temporary log, and waits up to 900 s for /health (PT2_COMPILE warms up for
# minutes before it serves). The server's log is printed if it exits or does not become healthy.
start_server() {
    log=$(mktemp -t tgis-bench-server.XXXXXX)
    env ${server_env[@]+"${server_env[@]}"} "$@" MODEL_NAME="$model_dir" GRPC_PORT="$grpc_port" \
        PORT="$http_port" "${server_cmd[@]}" >"$log" 2>&1 &
    server=$!
    trap stop_server EXIT
    echo "Serving $model_dir $* (gRPC $grpc_port, HTTP $http_port); waiting for /health" >&2
    local deadline=$((SECONDS + 900))
    until "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$http_port/health" 2>/dev/null; do
        if ! kill -0 "$server" 2>/dev/null; then
            echo "The server exited during startup:" >&2
            cat "$log" >&2
            exit 1
        fi
        if ((SECONDS > deadline)); then
            echo "The server did not become healthy within 900 s:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 1
    done
}

stop_server() {
    if [[ -n ${server:-} ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    # SERVER_LOGS=DIR keeps each server's log there.
    if [[ -n ${SERVER_LOGS:-} && -f ${log:-} ]]; then
        mkdir -p "$SERVER_LOGS" && cp "$log" "$SERVER_LOGS/"
    fi
    rm -f "${log:-}"
}
