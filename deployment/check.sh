#!/usr/bin/env bash
# Render every kustomization under deployment/ and stop at the first error:
#   - each model overlay (models/*) and each KServe directory (kserve/*),
#   - base alone, and base + each component under patches/ on its own.
# Uses `kustomize build` when a kustomize binary is on PATH, else `kubectl kustomize`.
# Set KUSTOMIZE=... to force one (e.g. KUSTOMIZE="kubectl kustomize").
# When `kubernetes-validate` (PyPI) is on PATH, every rendering is also checked
# against the Kubernetes OpenAPI schemas in strict mode (CRDs such as KServe's
# have no schema there and are skipped).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

if [[ -n "${KUSTOMIZE:-}" ]]; then
    read -r -a kustomize <<<"$KUSTOMIZE"
elif command -v kustomize >/dev/null 2>&1; then
    kustomize=(kustomize build)
elif command -v kubectl >/dev/null 2>&1; then
    kustomize=(kubectl kustomize)
else
    echo "check.sh: neither kustomize nor kubectl is on PATH" >&2
    exit 127
fi

validate=()
if command -v kubernetes-validate >/dev/null 2>&1; then
    validate=(kubernetes-validate --strict --quiet --no-warn)
fi

scratch="$(mktemp -d "$here/.check.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

# render LABEL DIR KIND...: build DIR, and require each KIND among the rendered objects.
render() {
    local label="$1" dir="$2" out kind
    shift 2
    if ! out="$("${kustomize[@]}" --load-restrictor LoadRestrictionsNone "$dir" 2>&1)"; then
        echo "FAIL $label" >&2
        echo "$out" >&2
        exit 1
    fi
    if [[ ${#validate[@]} -gt 0 ]] && ! "${validate[@]}" - <<<"$out" >&2; then
        echo "FAIL $label: schema validation" >&2
        exit 1
    fi
    for kind in "$@"; do
        if ! grep -q "^kind: $kind\$" <<<"$out"; then
            echo "FAIL $label: no $kind in the output" >&2
            exit 1
        fi
    done
    echo "ok   $label"
}

render base base Deployment Service

# Components cannot be built alone: compose each with base in a scratch overlay.
while IFS= read -r component; do
    name="${component#patches/}"
    overlay="$scratch/${name//\//_}"
    mkdir -p "$overlay"
    printf 'resources:\n  - ../../base\ncomponents:\n  - ../../%s\n' "$component" >"$overlay/kustomization.yaml"
    render "base + $component" "$overlay" Deployment
done < <(find patches -name kustomization.yaml -exec dirname {} \; | sort)

for overlay in models/*/; do
    render "${overlay%/}" "${overlay%/}" Deployment Service
done

render monitoring monitoring ConfigMap
render gateway gateway Deployment InferencePool HTTPRoute
render kserve/runtime kserve/runtime ServingRuntime
render kserve/example kserve/example ServingRuntime InferenceService

echo "all kustomizations render (${kustomize[*]}${validate:+; schemas: ${validate[*]}})"
