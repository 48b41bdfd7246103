#!/usr/bin/env bash
# The main job on a local default: a local control plane (kube-apiserver + etcd), pools with
# real allocations the way the whereabouts CNI writes them, and `ipreclaim controller`
# reclaiming the leaked ones. Prints the pool before and after, and the Events.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=$("$root/scripts/setup.sh" | tail -n 1)
export PATH="$bin:$PATH"
cargo build --quiet --bin ipreclaim --bin controlplane --package ipreclaim --package testenv
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== starting a local control plane"
./target/debug/controlplane >"$work/controlplane.out" 2>&1 &
pids+=($!)
for _ in $(seq 1 120); do grep -q 'export KUBECONFIG' "$work/controlplane.out" 2>/dev/null && break; sleep 0.5; done
grep -q 'export KUBECONFIG' "$work/controlplane.out" || { cat "$work/controlplane.out"; exit 1; }
KUBECONFIG=$(sed -n 's/.*export KUBECONFIG=//p' "$work/controlplane.out")
export KUBECONFIG
kubectl apply -f crds/ >/dev/null
kubectl wait --for=condition=Established crd --all --timeout=60s >/dev/null

ns=demo
status() { # pod-name ip
  printf '[{"name":"cbr0","interface":"eth0","ips":["10.244.0.9"],"default":true},{"name":"%s/macvlan","interface":"net1","ips":["%s"]}]' "$ns" "$2"
}
pod() { # name ip
  kubectl -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $1
  annotations:
    k8s.v1.cni.cncf.io/network-status: '$(status "$1" "$2")'
spec:
  containers: [{name: app, image: localhost/ipreclaim/pause:1}]
YAML
}
kubectl create namespace "$ns" >/dev/null
kubectl -n "$ns" apply -f - >/dev/null <<YAML
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: macvlan}
spec:
  config: '{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}'
---
apiVersion: whereabouts.cni.cncf.io/v1alpha1
kind: IPPool
metadata: {name: 192.0.2.0-24}
spec:
  range: 192.0.2.0/24
  allocations:
    "10": {id: sandbox-web-0, podref: $ns/web-0, ifname: net1}
    "11": {id: sandbox-web-1, podref: $ns/web-1, ifname: net1}
    "12": {id: sandbox-gone-0, podref: $ns/gone-0, ifname: net1}
    "13": {id: sandbox-old-web-1, podref: $ns/web-1, ifname: net1}
YAML
pod web-0 192.0.2.10
pod web-1 192.0.2.11
echo "== pool before: web-0 and web-1 live; gone-0 was deleted while no controller ran; .13 is a stale sandbox of web-1"
kubectl -n "$ns" get ippool 192.0.2.0-24 -o jsonpath='{range .spec.allocations.*}{.podref}{" "}{.id}{"\n"}{end}'

echo "== starting ipreclaim controller"
./target/debug/ipreclaim controller --whereabouts-namespace "$ns" --leader-election=false \
  --sweep-interval 2s --leak-grace 5s --metrics-addr 127.0.0.1:18080 >"$work/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:18080/readyz >/dev/null && break; sleep 0.5; done

echo "== deleting pod web-0"
kubectl -n "$ns" delete pod web-0 --grace-period=0 --force >/dev/null 2>&1
for _ in $(seq 1 60); do
  left=$(kubectl -n "$ns" get ippool 192.0.2.0-24 -o jsonpath='{.spec.allocations}')
  [[ $left != *sandbox-web-0* && $left != *sandbox-gone-0* && $left != *sandbox-old-web-1* ]] && break
  sleep 0.5
done
echo "== pool after: only web-1's current address is left"
kubectl -n "$ns" get ippool 192.0.2.0-24 -o jsonpath='{range .spec.allocations.*}{.podref}{" "}{.id}{"\n"}{end}'
echo "== events"
kubectl -n "$ns" get events --field-selector reason=IPAddressGarbageCollected -o custom-columns=REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message
echo "== metrics"
# Gauges refresh on each sweep (every 2s here).
for _ in $(seq 1 20); do
  curl -s http://127.0.0.1:18080/metrics | grep -q '^ipreclaim_allocations{pool="demo/192.0.2.0-24"} 1$' && break
  sleep 0.5
done
curl -s http://127.0.0.1:18080/metrics | grep -E '^ipreclaim_(releases_total|allocations|deletion_to_release_seconds_count|api_writes_total)'
