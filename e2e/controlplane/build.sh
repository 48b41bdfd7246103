#!/usr/bin/env bash
# Builds kube-apiserver, kubectl, kubelet, kube-controller-manager, kube-scheduler, kube-proxy, etcd and helm
# (and kubeadm for the kind node image: `build.sh kind`)
# from their Go modules, and the whereabouts and Multus CNI plugins from the release sources in
# ../shared/third_party (the Go module proxy refuses those), into a cache outside the work tree;
# reuses what is already there. Prints the bin directory last.
#   IPRECLAIM_CACHE        cache root (default ~/.cache/ipreclaim)
#   IPRECLAIM_THIRD_PARTY  folder with the whereabouts/multus archives (default <repo>/../shared/third_party)
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
  local c missing=()
  for c in "${KUBE_CMDS[@]}"; do [[ -x "$bin/$c-$v" ]] || missing+=("$c"); done
  if ((${#missing[@]} == 0)); then return; fi
  log "building ${missing[*]} $v (takes several minutes the first time)"
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
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubeadm"
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
    for c in "${missing[@]}"; do
      go build -trimpath -tags selinux,notest -ldflags "$ld" -o "$bin/$c-$v.tmp" "k8s.io/kubernetes/cmd/$c"
      mv "$bin/$c-$v.tmp" "$bin/$c-$v"
    done
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

# CoreDNS, the DNS addon kubeadm installs (the kind node image), from its Go module at the
# version kubeadm pairs with Kubernetes (cmd/kubeadm/app/constants CoreDNSVersion).
build_coredns() {
  local v=$COREDNS_VERSION
  if [[ -x "$bin/coredns-$v" ]]; then return; fi
  log "building coredns $v"
  local dir="$cache/src/coredns-$v" cdir
  mkdir -p "$dir"
  cdir=$(cd "$dir" && go mod download -json "github.com/coredns/coredns@$v" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  {
    echo "module ipreclaim.local/coredns-build"
    grep -E '^go ' "$cdir/go.mod"
    echo "require github.com/coredns/coredns $v"
  } > "$dir/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/coredns/coredns"\n' > "$dir/tools.go"
  (
    cd "$dir"
    go mod tidy -e >/dev/null 2>&1
    go build -trimpath -ldflags "-s -w" -o "$bin/coredns-$v.tmp" github.com/coredns/coredns
    mv "$bin/coredns-$v.tmp" "$bin/coredns-$v"
  )
}

build_plain() { # name module-path/cmd version
  local name=$1 pkg=$2 v=$3
  if [[ -x "$bin/$name-$v" ]]; then return; fi
  log "building $name $v"
  GOBIN="$cache/src/gobin-$name-$v" go install -trimpath -ldflags "-s -w" "$pkg@$v"
  mv "$cache/src/gobin-$name-$v/$name" "$bin/$name-$v"
}

# whereabouts (CNI IPAM plugin) and the Multus thin plugin, from the release archives, with the
# network-attachment-definition client they need replaced by its archive too.
third_party=${IPRECLAIM_THIRD_PARTY:-$here/../../../shared/third_party}
unpack() { # archive-name -> prints the unpacked directory
  local name=$1 dest="$cache/src/${1%.tar.gz}"
  if [[ ! -d "$dest" ]]; then
    [[ -f "$third_party/$name" ]] || {
      log "missing $third_party/$name: set IPRECLAIM_THIRD_PARTY to the folder with the whereabouts and Multus release archives (see e2e/README.md)"
      exit 1
    }
    mkdir -p "$dest.tmp"
    tar -xzf "$third_party/$name" -C "$dest.tmp"
    # Archives hold one top-level directory; keep its content.
    local top
    top=$(find "$dest.tmp" -mindepth 1 -maxdepth 1)
    if [[ $(echo "$top" | wc -l) -eq 1 && -d "$top" ]]; then mv "$top" "$dest"; rm -rf "$dest.tmp"; else mv "$dest.tmp" "$dest"; fi
  fi
  echo "$dest"
}
build_cni() { # name version archive package extra-flags...
  local name=$1 v=$2 archive=$3 pkg=$4; shift 4
  if [[ -x "$bin/$name-$v" ]]; then return; fi
  log "building $name $v from $archive.tar.gz"
  local src nad
  src=$(unpack "$archive.tar.gz")
  nad=$(unpack "network-attachment-definition-client-$NAD_CLIENT_VERSION.tar.gz")
  (
    cd "$src"
    go mod edit -replace "github.com/k8snetworkplumbingwg/network-attachment-definition-client=$nad"
    go build "$@" -trimpath -ldflags "-s -w" -o "$bin/$name-$v.tmp" "$pkg"
  )
  mv "$bin/$name-$v.tmp" "$bin/$name-$v"
}
build_whereabouts() { build_cni whereabouts "$WHEREABOUTS_VERSION" "whereabouts-$WHEREABOUTS_VERSION" ./cmd/ -mod=mod; }
build_whereabouts_controlloop() { build_cni whereabouts-controlloop "$WHEREABOUTS_VERSION" "whereabouts-$WHEREABOUTS_VERSION" ./cmd/controlloop -mod=mod; }
build_multus() { build_cni multus "$MULTUS_VERSION" "multus-cni-$MULTUS_VERSION" ./cmd/multus -mod=mod; }
# The images of the kind suite: whereabouts' reconciler, Multus thick (daemon, shim, installer,
# the passthru plugin the installer copies too).
build_kind_cni() {
  build_cni whereabouts-reconciler "$WHEREABOUTS_VERSION" "whereabouts-$WHEREABOUTS_VERSION" ./cmd/reconciler -mod=mod
  local c
  for c in multus-daemon multus-shim install_multus; do
    build_cni "$c" "$MULTUS_VERSION" "multus-cni-$MULTUS_VERSION" "./cmd/$c" -mod=mod
  done
  build_cni passthru "$MULTUS_VERSION" "multus-cni-$MULTUS_VERSION" ./cmd/passthru-cni -mod=mod
}

KUBE_CMDS=(kube-apiserver kubectl)
start=$(date +%s)
what=${1:-all}
case $what in
  all) KUBE_CMDS+=(kubelet kube-controller-manager kube-scheduler kube-proxy)
       build_etcd; build_kubernetes
       build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
       build_whereabouts; build_whereabouts_controlloop; build_multus ;;
  controlplane) build_etcd; build_kubernetes
       build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
  node) KUBE_CMDS+=(kubelet kube-controller-manager kube-scheduler kube-proxy); build_kubernetes
       build_whereabouts; build_whereabouts_controlloop; build_multus ;;
  kubernetes) build_kubernetes ;;
  kind) KUBE_CMDS+=(kubelet kube-controller-manager kube-scheduler kube-proxy kubeadm); build_etcd; build_kubernetes
       build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
       build_coredns; build_whereabouts; build_whereabouts_controlloop; build_kind_cni ;;
  etcd) build_etcd ;;
  helm) build_plain helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
  *) log "usage: $0 [all|controlplane|node|kind|kubernetes|etcd|helm]"; exit 2 ;;
esac
# Unversioned links so tools find the pinned build.
# A link already right is left alone: the kind suite's builds run this beside the tests
# (scripts/test.sh --kind), and `ln -sf` removes the link before it makes it again.
link() { [[ -x "$bin/$2" && $(readlink "$bin/$1") != "$2" ]] && ln -sf "$2" "$bin/$1"; return 0; }
for n in kube-apiserver kubectl kubelet kube-controller-manager kube-scheduler kube-proxy kubeadm; do link "$n" "$n-$KUBERNETES_VERSION"; done
link etcd "etcd-$ETCD_VERSION"
link helm "helm-$HELM_VERSION"
link whereabouts "whereabouts-$WHEREABOUTS_VERSION"
link whereabouts-controlloop "whereabouts-controlloop-$WHEREABOUTS_VERSION"
link multus "multus-$MULTUS_VERSION"
log "setup took $(( $(date +%s) - start ))s"
echo "$bin"
