#!/usr/bin/env bash
# The end-to-end scenarios on a real node on this machine (as root; no Docker, no internet):
#   1. scripts/setup.sh: packages, and kube-apiserver, etcd, kubelet, kube-controller-manager,
#      kube-scheduler, kubectl, helm, whereabouts and Multus built from source (cached);
#   2. ipreclaim's image from the Dockerfile (scripts/image.sh: buildah on stand-in bases made
#      here, checked as a scanner would), saved for the node's containerd;
#   3. the scenarios (tests/e2e/, the same code the kind suite runs): the test process starts
#      testenv's node (one per machine, a lock), installs whereabouts' and Multus's own CRDs,
#      imports that image, `helm install`s charts/ipreclaim (two controller
#      replicas with leader election, the node agent on the node's CRI socket), runs the
#      cluster scenarios and the node-only ones (crash, reboot), and puts the host back at exit.
# Usage: e2e/node/run.sh [more test-name filters]
# Logs: target/testenv/node/ (kubelet, containerd, Multus, whereabouts, pod-logs/) and
# target/testenv/controlplane-*/ (kube-apiserver, etcd); kept until the next run.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
if [[ $(id -u) -ne 0 ]]; then
  echo "e2e/node/run.sh: a real node needs root (kubelet, containerd, bridges, cgroups)" >&2
  exit 1
fi
bin=$("$root/scripts/setup.sh" | tail -n 1)
export IPRECLAIM_BIN_DIR="$bin"
cd "$root"
IMAGE=localhost/ipreclaim/ipreclaim:e2e "$root/scripts/image.sh" amd64
IPRECLAIM_E2E=node cargo test --locked --features root-tests --test e2e -- --test-threads=1 ::cluster node_only:: "$@"
