#!/usr/bin/env bash
# Render one model overlay and apply it to the current kubectl context.
#
#   ./deploy_model.sh <model> [extra `kubectl apply` args, e.g. -n my-namespace or --dry-run=server]
#
# <model> is a directory under models/ (see the usage message for the list).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    echo "usage: $(basename "$0") <model> [kubectl apply args...]"
    local dir names=()
    for dir in "$here"/models/*/; do
        dir="${dir%/}"
        names+=("${dir##*/}")
    done
    echo "models: ${names[*]}"
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    usage >&2
    exit 2
fi
model="$1"
shift
overlay="$here/models/$model"
if [[ -z "$model" || "$model" == */* || ! -f "$overlay/kustomization.yaml" ]]; then
    echo "error: no model overlay models/$model" >&2
    usage >&2
    exit 1
fi

# The standalone kustomize binary if there is one, else the copy built into kubectl.
render() {
    if command -v kustomize >/dev/null 2>&1; then
        kustomize build --load-restrictor LoadRestrictionsNone "$1"
    else
        kubectl kustomize --load-restrictor LoadRestrictionsNone "$1"
    fi
}

# Render fully before applying, so that a broken overlay applies nothing.
manifests="$(render "$overlay")"
kubectl apply "$@" -f - <<<"$manifests"
