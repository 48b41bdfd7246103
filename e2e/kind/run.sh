#!/usr/bin/env bash
# The kind end-to-end suite, for a machine with Docker and internet (CI: .github/workflows/e2e.yaml):
#   1. a kind cluster, Multus (thick) and the whereabouts CNI at pinned versions,
#   2. whereabouts' own ip-control-loop turned off (the migration step in the README),
#   3. ipreclaim's image built and loaded with `kind load`, its chart installed,
#   4. the e2e scenarios (tests/e2e/, the same code the local suite and the real node run) against the cluster.
# Usage: e2e/kind/run.sh [--keep]   (--keep leaves the cluster up for a look)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cluster=ipreclaim-e2e
image=ipreclaim:e2e
keep=false
[[ "${1:-}" == "--keep" ]] && keep=true

need() { command -v "$1" >/dev/null || { echo "missing $1: $2" >&2; exit 1; }; }
need docker "install Docker"
need go "install Go"
# kubectl and helm: built from their Go modules like the local suite's.
bin=$("$root/scripts/setup.sh" | tail -n 1)
export PATH="$bin:$HOME/go/bin:$PATH"
command -v kind >/dev/null || go install "sigs.k8s.io/kind@$KIND_VERSION"

cleanup() { $keep || kind delete cluster --name "$cluster"; }
trap cleanup EXIT

kind create cluster --name "$cluster" --image "$KIND_NODE_IMAGE" --config "$here/cluster.yaml" --wait 120s
export KUBECONFIG
KUBECONFIG=$(mktemp)
kind get kubeconfig --name "$cluster" >"$KUBECONFIG"

echo "== Multus $MULTUS_VERSION, whereabouts $WHEREABOUTS_VERSION"
# Their manifests from the pinned release sources in ../shared/third_party when that is there
# (a machine without internet), else from the release tags on GitHub.
third_party=${IPRECLAIM_THIRD_PARTY:-$root/../shared/third_party}
if [[ -f $third_party/multus-cni-$MULTUS_VERSION.tar.gz && -f $third_party/whereabouts-$WHEREABOUTS_VERSION.tar.gz ]]; then
  sources=$(mktemp -d)
  tar -xzf "$third_party/multus-cni-$MULTUS_VERSION.tar.gz" -C "$sources"
  tar -xzf "$third_party/whereabouts-$WHEREABOUTS_VERSION.tar.gz" -C "$sources"
  multus="$sources/multus-cni-$MULTUS_VERSION/deployments"
  wa="$sources/whereabouts-$WHEREABOUTS_VERSION/doc/crds"
else
  multus="https://raw.githubusercontent.com/k8snetworkplumbingwg/multus-cni/$MULTUS_VERSION/deployments"
  wa="https://raw.githubusercontent.com/k8snetworkplumbingwg/whereabouts/$WHEREABOUTS_VERSION/doc/crds"
fi
kubectl apply -f "$multus/multus-daemonset-thick.yml"
# whereabouts as its v0.9 install has it: the CRDs, the DaemonSet (CNI install, token watcher
# and ip-control-loop) and the reconciler Deployment.
kubectl apply -f "$wa/whereabouts.cni.cncf.io_ippools.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_nodeslicepools.yaml" \
  -f "$wa/daemonset-install.yaml" \
  -f "$wa/reconciler-deployment.yaml"
echo "== migration (README: Migrating from whereabouts' ip-control-loop and ip-reconciler)"
# Keep the CNI install and token watcher, drop whereabouts' own control loop ...
kubectl -n kube-system patch daemonset whereabouts --type=json -p '[{"op":"replace","path":"/spec/template/spec/containers/0/args","value":["-c","SLEEP=false source /install-cni.sh\nexec /token-watcher.sh"]}]'
# ... and its reconciler, which since v0.9 is a Deployment (older releases: a CronJob).
kubectl -n kube-system scale deployment whereabouts-reconciler --replicas=0
kubectl -n kube-system delete cronjob ip-reconciler --ignore-not-found
kubectl -n kube-system rollout status daemonset/kube-multus-ds --timeout=300s
kubectl -n kube-system rollout status daemonset/whereabouts --timeout=300s
for _ in $(seq 120); do
  [[ -z $(kubectl -n kube-system get pods -l name=whereabouts-reconciler -o name) ]] && break
  sleep 1
done
[[ -z $(kubectl -n kube-system get pods -l name=whereabouts-reconciler -o name) ]] ||
  { echo "migration: the whereabouts-reconciler pod is still there" >&2; exit 1; }
# Nothing of whereabouts' cleanup is left running.
if kubectl -n kube-system get pods -l name=whereabouts -o jsonpath='{.items[*].spec.containers[*].args}' | grep -q ip-control-loop; then
  echo "migration: a whereabouts pod still runs ip-control-loop" >&2
  exit 1
fi

echo "== ipreclaim image and chart"
# --skip-crds below keeps whereabouts' own CRDs; ipreclaim's fence records need its one CRD.
kubectl apply -f "$root/crds/ipfences.ipreclaim.io.yaml"
docker build -t "$image" "$root"
kind load docker-image "$image" --name "$cluster"
helm install ipreclaim "$root/charts/ipreclaim" --namespace ipreclaim --create-namespace \
  --skip-crds \
  --set image.repository=ipreclaim --set image.tag=e2e --set image.pullPolicy=Never \
  --set controller.leakGrace=5s --set controller.sweepInterval=5s \
  --set nodeAgent.sandboxGrace=5s \
  --wait --timeout 300s

echo "== scenarios"
cd "$root"
IPRECLAIM_E2E=kind IPRECLAIM_E2E_NAMESPACE=ipreclaim cargo test --locked --test e2e -- --test-threads=1 ::cluster

echo "== Events"
kubectl get events -A --field-selector reason=IPAddressGarbageCollected
