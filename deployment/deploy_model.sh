#!/usr/bin/env bash
# Render one model overlay and apply it to the current kubectl context.
#
#   ./deploy_model.sh [--image REF] <model> [extra `kubectl apply` args, e.g. -n my-namespace or --dry-run=server]
#
# <model> is a directory under models/ (see the usage message for the list). --image (or IMAGE=REF)
# serves that image instead of text-gen-server:latest, e.g. --image quay.io/me/text-gen-server:1.2.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    echo "usage: $(basename "$0") [--image REF] <model> [kubectl apply args...]"
    local dir names=()
    for dir in "$here"/models/*/; do
        dir="${dir%/}"
        names+=("${dir##*/}")
    done
    echo "models: ${names[*]}"
}

image="${IMAGE:-}"
if [[ "${1:-}" == "--image" ]]; then
    [[ $# -ge 2 && -n "$2" ]] || { echo "error: --image needs an image reference" >&2; exit 2; }
    image="$2"
    shift 2
fi
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

if [[ -n "$image" ]]; then
    # A throwaway overlay over the model's: kustomize's own image override, tag or digest included.
    wrapper="$(mktemp -d "$here/.image.XXXXXX")"  # kustomize takes only relative resource paths
    trap 'rm -rf "$wrapper"' EXIT
    name="$image" pin=""
    case "${image##*/}" in
        *@*) name="${image%@*}" pin="    digest: \"${image#*@}\"" ;;
        *:*) name="${image%:*}" pin="    newTag: \"${image##*:}\"" ;;
    esac
    printf 'resources:\n  - %s\nimages:\n  - name: text-gen-server\n    newName: \"%s\"\n%s\n' \
        "../models/$model" "$name" "$pin" >"$wrapper/kustomization.yaml"
    overlay="$wrapper"
fi

# Render fully before applying, so that a broken overlay applies nothing.
manifests="$(render "$overlay")"
kubectl apply "$@" -f - <<<"$manifests"
