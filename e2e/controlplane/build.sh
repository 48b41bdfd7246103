#!/usr/bin/env bash
# Builds kube-apiserver, kubectl, etcd and helm from their Go modules into a cache
# outside the work tree, and reuses what is already there. Prints the bin directory last.
#   IPRECLAIM_CACHE  cache root (default ~/.cache/ipreclaim)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache=${IPRECLAIM_CACHE:-$HOME/.cache/ipreclaim}
bin="$cache/bin"
mkdir -p "$bin" "$cache/src"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { echo "controlplane: $*" >&2; }

# A wrapper module: k8s.io/kubernetes replaces every staging module with ./staging/..., which
# does not exist in the module cache, so point each one at its published v0.<minor>.<patch>.
build_kubernetes() {
  local v=$KUBERNETES_VERSION
  if [[ -x "$bin/kube-apiserver-$v" && -x "$bin/kubectl-$v" ]]; then return; fi
  log "building kube-apiserver and kubectl $v (takes several minutes the first time)"
  local dir="$cache/src/kubernetes-$v"
  mkdir -p "$dir"
  local kdir
  kdir=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  [[ -f "$kdir/go.mod" ]] || { log "could not download k8s.io/kubernetes@$v"; exit 1; }
  local staging="v0.${v#v1.}"
  {
    echo "module ipreclaim.local/kubernetes-build"
    grep -E '^(go|godebug) ' "$kdir/go.mod"
    echo "require k8s.io/kubernetes $v"
    sed -n -E 's#^[[:space:]]*(replace[[:space:]]+)?(k8s\.io/[^[:space:]]+)[[:space:]]+=>[[:space:]]+\./staging/.*#replace \2 => \2 '"$staging"'#p' "$kdir/go.mod"
  } > "$dir/go.mod"
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  local major=1 minor
  minor=$(echo "$v" | cut -d. -f2)
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  (
    cd "$dir"
    go mod tidy -e >/dev/null 2>&1
    go build -trimpath -tags selinux,notest -ldflags "$ld" -o "$bin/kube-apiserver-$v" k8s.io/kubernetes/cmd/kube-apiserver
    go build -trimpath -tags selinux,notest -ldflags "$ld" -o "$bin/kubectl-$v" k8s.io/kubernetes/cmd/kubectl
  )
}

build_etcd() {
  local v=$ETCD_VERSION
  if [[ -x "$bin/etcd-$v" ]]; then return; fi
  log "building etcd $v"
  local dir="$cache/src/etcd-$v"
  mkdir -p "$dir"
  local edir
  edir=$(cd "$dir" && go mod download -json "go.etcd.io/etcd/server/v3@$v" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  {
    echo "module ipreclaim.local/etcd-build"
    grep -E '^go ' "$edir/go.mod"
    echo "require go.etcd.io/etcd/server/v3 $v"
  } > "$dir/go.mod"
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
  (
    cd "$dir"
    go mod tidy -e >/dev/null 2>&1
    go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$v" -o "$bin/etcd-$v" go.etcd.io/etcd/server/v3
  )
}

build_plain() { # name module-path/cmd version
  local name=$1 pkg=$2 v=$3
  if [[ -x "$bin/$name-$v" ]]; then return; fi
  log "building $name $v"
  GOBIN="$cache/src/gobin-$name-$v" go install -trimpath -ldflags "-s -w" "$pkg@$v"
  mv "$cache/src/gobin-$name-$v/$name" "$bin/$name-$v"
}

start=$(date +%s)
what=${1:-all}
case $what in
  all) build_etcd; build_kubernetes
       build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
  kubernetes) build_kubernetes ;;
  etcd) build_etcd ;;
  helm) build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
  *) log "usage: $0 [all|kubernetes|etcd|helm]"; exit 2 ;;
esac
# Unversioned links so tools find the pinned build.
for n in kube-apiserver kubectl etcd helm; do
  v_var=$(case $n in kube-apiserver|kubectl) echo "$KUBERNETES_VERSION";; etcd) echo "$ETCD_VERSION";; helm) echo "$HELM_VERSION";; esac)
  [[ -x "$bin/$n-$v_var" ]] && ln -sf "$n-$v_var" "$bin/$n"
done
log "setup took $(( $(date +%s) - start ))s"
echo "$bin"
