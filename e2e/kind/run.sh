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
kubectl apply -f "https://raw.githubusercontent.com/k8snetworkplumbingwg/multus-cni/$MULTUS_VERSION/deployments/multus-daemonset-thick.yml"
wa="https://raw.githubusercontent.com/k8snetworkplumbingwg/whereabouts/$WHEREABOUTS_VERSION/doc/crds"
kubectl apply -f "$wa/whereabouts.cni.cncf.io_ippools.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_nodeslicepools.yaml" \
  -f "$wa/daemonset-install.yaml"
# Migration: keep the CNI install and token watcher, drop whereabouts' own control loop.
kubectl -n kube-system patch daemonset whereabouts --type=json -p '[{"op":"replace","path":"/spec/template/spec/containers/0/args","value":["-c","SLEEP=false source /install-cni.sh\nexec /token-watcher.sh"]}]'
kubectl -n kube-system delete cronjob ip-reconciler --ignore-not-found
kubectl -n kube-system rollout status daemonset/kube-multus-ds --timeout=300s
kubectl -n kube-system rollout status daemonset/whereabouts --timeout=300s

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
