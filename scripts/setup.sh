#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine and builds the Go-built
# binaries (kube-apiserver, kubectl, etcd, helm) into the cache. Safe to run again: it only
# installs or builds what is missing. Prints the bin directory on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)

packages=(protobuf-compiler containerd runc containernetworking-plugins iproute2 iptables shellcheck gcc libc6-dev curl wget)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: need root to install ${missing[*]} (sudo apt-get install -y ${missing[*]})" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Debian's prometheus ships the server and promtool (the alert and dashboard tests). Without
# its recommends: prometheus-node-exporter is not needed. Where systemd runs, the package
# enables a prometheus service on :9090; the tests start their own on other ports.
if ! dpkg -s prometheus >/dev/null 2>&1; then
  echo "setup: installing prometheus" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: need root to install prometheus (sudo apt-get install -y --no-install-recommends prometheus)" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
fi

bin=$("$root/e2e/controlplane/build.sh" all | tail -n 1)
echo "setup: done in $(( $(date +%s) - start ))s" >&2
echo "$bin"
