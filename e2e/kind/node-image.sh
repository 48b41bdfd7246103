#!/usr/bin/env bash
# Builds, on this machine and from sources only (no registry, no Docker), the kind node image
# and the images the kind suite loads into it. As root on Debian 12 (debootstrap, buildah).
#   - the node's root filesystem: Debian bookworm from debootstrap with systemd, containerd,
#     runc and the CNI plugins from Debian, kind's base files from its Go module
#     (images/base/files: entrypoint, containerd config, kubelet units), kubelet, kubeadm and
#     kubectl built from the k8s.io/kubernetes Go module (e2e/controlplane/build.sh kind), and
#     a wrapper entrypoint that makes /sys and the cgroup v1 hierarchies writable (the node runs
#     without --privileged: kind-unprivileged.patch);
#   - the images kubeadm runs, made from binaries built here and imported into the node's
#     containerd at build time: kube-apiserver, kube-controller-manager, kube-scheduler,
#     kube-proxy (with Debian's iptables), etcd, pause (kubernetes' pause.c), CoreDNS;
#   - the suite's images, saved as docker-archives for `kind load image-archive`: Multus thick
#     and whereabouts, from the release sources in ../shared/third_party.
# Everything is cached under ~/.cache/ipreclaim/kind and rebuilt only when an input changes.
# Prints, last, the node root filesystem tar (for `docker import`, see run.sh); the suite's
# images are in $cache/images/.
# Usage: e2e/kind/node-image.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../controlplane/versions.env
. "$root/e2e/controlplane/versions.env"
cache=${IPRECLAIM_CACHE:-$HOME/.cache/ipreclaim}/kind
images=$cache/images
mkdir -p "$cache" "$images"
start=$(date +%s)
say() { echo "node-image: $*" >&2; }
[[ $(id -u) -eq 0 ]] || { say "needs root (debootstrap, buildah, a private containerd)"; exit 1; }
for p in debootstrap buildah gcc libc6-dev busybox-static; do
  dpkg -s "$p" >/dev/null 2>&1 || { say "installing $p"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null; }
done
# One build at a time.
exec 8>"$cache/build.lock"
flock 8

# --- the Debian root filesystem (cached) ---------------------------------------------------
# kind's base image list (images/base/Dockerfile) less the storage-test packages, with
# containerd, runc and the CNI plugins from Debian instead of kind's own builds.
packages=systemd,systemd-sysv,dbus,containerd,runc,containernetworking-plugins,iptables,nftables,iproute2,ethtool,conntrack,socat,util-linux,mount,kmod,libseccomp2,procps,ca-certificates,ebtables,pigz,jq
base=$cache/rootfs-bookworm
make_rootfs() {
  [[ $(cat "$base.done" 2>/dev/null) != "$packages" ]] || return 0
  say "debootstrap bookworm ($packages); a few minutes"
  rm -rf "$base" "$base.tmp"
  debootstrap --variant=minbase --include="$packages" bookworm "$base.tmp" http://deb.debian.org/debian \
    >"$cache/debootstrap.log" 2>&1 || { tail -n 20 "$cache/debootstrap.log" >&2; return 1; }
  rm -rf "$base.tmp"/var/cache/apt/archives/*.deb "$base.tmp"/var/lib/apt/lists/*
  mv "$base.tmp" "$base"
  echo "$packages" >"$base.done"
}
# In the background while the Go builds below take the CPU: debootstrap mostly downloads and
# unpacks (on a fresh machine it overlaps them).
make_rootfs &
rootfs_pid=$!
# An early exit below waits for it: no debootstrap left running on its own.
trap 'wait "$rootfs_pid" 2>/dev/null || true' EXIT

# --- binaries ------------------------------------------------------------------------------
bin=$("$root/e2e/controlplane/build.sh" kind | tail -n 1)
kv=$KUBERNETES_VERSION
kdir=$(cd "$cache" && go mod download -json "k8s.io/kubernetes@$kv" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
kinddir=$(cd "$cache" && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
# The versions kubeadm asks for (constants.go of the same module).
const() { sed -n "s/^[[:space:]]*$1 = \"\(.*\)\"/\1/p" "$kdir/cmd/kubeadm/app/constants/constants.go" | head -n 1; }
pause_version=$(const PauseVersion)
etcd_tag=$(const DefaultEtcdVersion)
coredns_tag=$(const CoreDNSVersion)
[[ ${etcd_tag%-*} == "${ETCD_VERSION#v}" ]] || { say "kubeadm $kv wants etcd $etcd_tag, the cache has $ETCD_VERSION"; exit 1; }
[[ $coredns_tag == "$COREDNS_VERSION" ]] || { say "kubeadm $kv wants CoreDNS $coredns_tag, versions.env has $COREDNS_VERSION"; exit 1; }
if [[ ! -x $cache/pause-$pause_version ]]; then
  say "pause $pause_version from $kdir/build/pause/linux/pause.c"
  gcc -Os -static -Wall -DVERSION="v$pause_version-ipreclaim" -o "$cache/pause-$pause_version.tmp" "$kdir/build/pause/linux/pause.c"
  strip "$cache/pause-$pause_version.tmp"
  mv "$cache/pause-$pause_version.tmp" "$cache/pause-$pause_version"
fi

wait "$rootfs_pid" || { say "debootstrap failed (log: $cache/debootstrap.log)"; exit 1; }

# --- images (buildah, from scratch; saved as docker-archives) ------------------------------
# A staging folder per image; the archive is rebuilt when the folder's content changes.
# mkimage REF ENTRYPOINT-JSON DIR
mkimage() {
  local ref=$1 entry=$2 dir=$3 out key c
  out=$images/$(echo "${ref#*/}" | tr '/:' '__').tar
  key=$( (echo "$ref $entry"; cd "$dir" && find . -printf '%p %m %l %s\n' | sort && find . -type f -print0 | sort -z | xargs -0 cat | sha256sum) | sha256sum)
  if [[ -f $out && $(cat "$out.key" 2>/dev/null) == "$key" ]]; then return; fi
  say "image $ref"
  c=$(buildah from --quiet scratch)
  buildah add --quiet "$c" "$dir" / >/dev/null
  buildah config --entrypoint "$entry" --env PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin \
    --label io.ipreclaim.built-here="from sources on this machine (e2e/kind/node-image.sh)" "$c"
  buildah commit --quiet --rm "$c" "$ref" >/dev/null
  rm -f "$out.tmp"
  buildah push --quiet "$ref" "docker-archive:$out.tmp:$ref" >/dev/null
  buildah rmi "$ref" >/dev/null
  mv "$out.tmp" "$out"
  echo "$key" >"$out.key"
}
stage=$cache/stage
# fresh NAME: an empty staging folder laid out as Debian's (merged /usr, /var/run), /tmp and
# root's /etc/passwd entry included.
fresh() {
  local d=${stage:?}/$1 x
  rm -rf "$d" && mkdir -p "$d/tmp" "$d/etc" && chmod 1777 "$d/tmp"
  for x in bin sbin lib lib64; do mkdir -p "$d/usr/$x" && ln -s "usr/$x" "$d/$x"; done
  # /var/run -> /run: Multus finds pod network namespaces under /var/run/netns (its DaemonSet
  # mounts the node's /run/netns).
  mkdir -p "$d/run" "$d/var" && ln -s ../run "$d/var/run"
  # root in /etc/passwd: Go's os/user without cgo reads it (multus-daemon checks it runs as root).
  echo 'root:x:0:0:root:/root:/bin/sh' >"$d/etc/passwd"
  echo 'root:x:0:' >"$d/etc/group"
  echo "$d"
}
# copy_with_libs DEST-ROOT FILE...: files of the Debian root filesystem with the libraries they
# load (ldd in that root), links kept.
copy_with_libs() {
  local dest=$1 f l; shift
  for f in "$@"; do
    mkdir -p "$dest$(dirname "$f")"
    cp -a "$base$f" "$dest$f"
    if [[ -L $base$f ]]; then
      l=$(readlink "$base$f"); [[ $l == /* ]] || l=$(dirname "$f")/$l
      copy_with_libs "$dest" "$l"
      continue
    fi
    [[ -f $base$f && -x $base$f || $f == *.so* ]] || continue
    { chroot "$base" ldd "$f" 2>/dev/null || true; } | { grep -oE '/[^ ]+' || true; } | while read -r l; do
      [[ -e $dest$l ]] || copy_with_libs "$dest" "$l"
    done
  done
}
busybox() { # DIR: a static busybox with its applets as links in /bin
  mkdir -p "$1/bin"
  cp /bin/busybox "$1/bin/busybox"
  local a
  for a in $(/bin/busybox --list); do [[ -e $1/bin/$a ]] || ln -s busybox "$1/bin/$a"; done
}

reg=registry.k8s.io
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  d=$(fresh "$c")
  install -D -m 0755 "$bin/$c-$kv" "$d/usr/local/bin/$c"
  mkimage "$reg/$c:$kv" "[\"/usr/local/bin/$c\"]" "$d"
done
d=$(fresh etcd)
install -D -m 0755 "$bin/etcd-$ETCD_VERSION" "$d/usr/local/bin/etcd"
mkdir -p "$d/var/lib/etcd"
mkimage "$reg/etcd:$etcd_tag" '["/usr/local/bin/etcd"]' "$d"
d=$(fresh pause)
install -D -m 0755 "$cache/pause-$pause_version" "$d/pause"
mkimage "$reg/pause:$pause_version" '["/pause"]' "$d"
d=$(fresh coredns)
install -D -m 0755 "$bin/coredns-$COREDNS_VERSION" "$d/coredns"
mkimage "$reg/coredns/coredns:$coredns_tag" '["/coredns"]' "$d"
# kube-proxy runs iptables: Debian's, both backends, and a wrapper that picks the one the
# node's kubelet uses (its KUBE-IPTABLES-HINT chain), as the upstream image's does.
d=$(fresh kube-proxy)
install -D -m 0755 "$bin/kube-proxy-$kv" "$d/usr/local/bin/kube-proxy"
busybox "$d"
copy_with_libs "$d" /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi /usr/sbin/conntrack
for so in "$base"/usr/lib/x86_64-linux-gnu/xtables/*.so; do copy_with_libs "$d" "${so#"$base"}"; done
cp -a "$base/etc/protocols" "$base/etc/services" "$base/etc/ethertypes" "$d/etc/" 2>/dev/null || true
install -m 0755 "$here/iptables-wrapper" "$d/usr/sbin/iptables-wrapper"
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  ln -sf iptables-wrapper "$d/usr/sbin/$t"
done
mkimage "$reg/kube-proxy:$kv" '["/usr/local/bin/kube-proxy"]' "$d"

# The suite's images, as their Dockerfiles lay them out (binaries from build.sh).
d=$(fresh multus)
for c in multus-daemon multus-shim install_multus passthru; do install -D -m 0755 "$bin/$c-$MULTUS_VERSION" "$d/usr/src/multus-cni/bin/$c"; done
mkimage "ghcr.io/k8snetworkplumbingwg/multus-cni:$MULTUS_VERSION-thick" '["/usr/src/multus-cni/bin/multus-daemon"]' "$d"
d=$(fresh whereabouts)
busybox "$d"
install -m 0755 "$bin/whereabouts-$WHEREABOUTS_VERSION" "$d/whereabouts"
install -m 0755 "$bin/whereabouts-controlloop-$WHEREABOUTS_VERSION" "$d/ip-control-loop"
install -m 0755 "$bin/whereabouts-reconciler-$WHEREABOUTS_VERSION" "$d/ip-reconciler"
for s in install-cni.sh lib.sh token-watcher.sh; do
  install -m 0755 "${IPRECLAIM_CACHE:-$HOME/.cache/ipreclaim}/src/whereabouts-$WHEREABOUTS_VERSION/script/$s" "$d/$s"
done
mkimage "ghcr.io/k8snetworkplumbingwg/whereabouts:$WHEREABOUTS_VERSION" '["/install-cni.sh"]' "$d"

# --- the node ------------------------------------------------------------------------------
node_images=(kube-apiserver_"$kv" kube-controller-manager_"$kv" kube-scheduler_"$kv" kube-proxy_"$kv"
  etcd_"$etcd_tag" pause_"$pause_version" coredns_coredns_"$coredns_tag")
key=$( (echo "$packages $kv $KIND_VERSION"; cat "$base.done" "$here/node-image.sh" "$here/entrypoint-unprivileged";
  sha256sum "$bin/kubelet-$kv" "$bin/kubeadm-$kv" "$bin/kubectl-$kv" | cut -d' ' -f1
  for i in "${node_images[@]}"; do cat "$images/$i.tar.key"; done) | sha256sum | cut -c1-12)
out=$cache/node-$kv-$key.tar
if [[ ! -f $out ]]; then
  say "node root filesystem ($key)"
  rm -f "$cache"/node-"$kv"-*.tar
  work=$cache/node-build
  rm -rf "$work"
  cp -a "$base" "$work"
  files=$kinddir/images/base/files
  # As kind's base Dockerfile lays its files out: scripts 0755, the rest 0644.
  install -m 0755 "$files"/usr/local/bin/* "$work/usr/local/bin/"
  mkdir -p "$work/kind/bin" "$work/etc/containerd" "$work/etc/default" "$work/etc/sysctl.d" \
    "$work/etc/systemd/system/kubelet.service.d" "$work/etc/kubernetes/manifests" "$work/LICENSES"
  install -m 0644 "$files"/kind/README.txt "$work/kind/"
  install -m 0755 "$files"/kind/bin/* "$work/kind/bin/"
  install -m 0644 "$files"/LICENSES/* "$work/LICENSES/"
  install -m 0644 "$files"/etc/crictl.yaml "$work/etc/"
  install -m 0644 "$files"/etc/containerd/* "$work/etc/containerd/"
  install -m 0644 "$files"/etc/default/* "$work/etc/default/"
  install -m 0644 "$files"/etc/sysctl.d/* "$work/etc/sysctl.d/"
  install -m 0644 "$files"/etc/systemd/system/*.service "$files"/etc/systemd/system/*.slice "$work/etc/systemd/system/"
  install -m 0644 "$files"/etc/systemd/system/kubelet.service.d/* "$work/etc/systemd/system/kubelet.service.d/"
  # The clean-up steps of kind's base Dockerfile.
  find "$work/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
  rm -f "$work"/lib/systemd/system/multi-user.target.wants/* "$work"/etc/systemd/system/*.wants/* \
    "$work"/lib/systemd/system/local-fs.target.wants/* "$work"/lib/systemd/system/sockets.target.wants/*udev* \
    "$work"/lib/systemd/system/sockets.target.wants/*initctl* "$work"/lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >>"$work/etc/systemd/journald.conf"
  systemctl --root="$work" enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
  systemctl --root="$work" mask systemd-binfmt.service >/dev/null 2>&1
  # Debian's containerd where kind's unit and scripts look for it; its CNI plugins where
  # containerd, Multus and whereabouts look (/opt/cni/bin, which the DaemonSets write into).
  ln -s /usr/bin/containerd "$work/usr/local/bin/containerd"
  ln -s /usr/bin/ctr "$work/usr/local/bin/ctr"
  mkdir -p "$work/opt/cni/bin" "$work/etc/cni/net.d"
  cp -a "$work"/usr/lib/cni/* "$work/opt/cni/bin/"
  # The runtime spec base: `ctr oci spec` with kind's hook and without rlimits (setting them
  # needs CAP_SYS_RESOURCE, which the node lacks), as kind's base Dockerfile makes it.
  chroot "$work" ctr oci spec | python3 -c '
import json, sys
s = json.load(sys.stdin)
s.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
s["process"].pop("rlimits", None)
json.dump(s, sys.stdout, indent=2)' >"$work/etc/containerd/cri-base.json"
  # restrict_oom_score_adj: a pod's negative oom_score_adj (the kubelet's -998 for sandboxes)
  # would need CAP_SYS_RESOURCE, which the node lacks ("can't get final child's PID from pipe").
  sed -i -e "s#sandbox_image = .*#sandbox_image = \"$reg/pause:$pause_version\"#" \
    -e "s#restrict_oom_score_adj = false#restrict_oom_score_adj = true#" "$work/etc/containerd/config.toml"
  # The pod network without kindnetd: containerd writes Debian's bridge plugin config with the
  # node's pod CIDR once the kubelet has it (run.sh routes each node's CIDR to it).
  cat >>"$work/etc/containerd/config.toml" <<'TOML'

[plugins."io.containerd.grpc.v1.cri".cni]
  conf_template = "/kind/cni-template.conflist"
TOML
  cat >"$work/kind/cni-template.conflist" <<'JSON'
{
  "cniVersion": "0.4.0",
  "name": "kind-bridge",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "{{.PodCIDR}}"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  install -m 0755 "$bin/kubelet-$kv" "$work/usr/bin/kubelet"
  install -m 0755 "$bin/kubeadm-$kv" "$work/usr/bin/kubeadm"
  install -m 0755 "$bin/kubectl-$kv" "$work/usr/bin/kubectl"
  echo "$kv" >"$work/kind/version"
  install -m 0755 "$here/entrypoint-unprivileged" "$work/usr/local/bin/entrypoint-unprivileged"
  # Check: the images kubeadm lists are the ones made above.
  want=$(chroot "$work" kubeadm config images list --kubernetes-version "$kv" 2>/dev/null | sort)
  have=$(for i in kube-apiserver kube-controller-manager kube-scheduler kube-proxy; do echo "$reg/$i:$kv"; done
    echo "$reg/coredns/coredns:$coredns_tag"; echo "$reg/pause:$pause_version"; echo "$reg/etcd:$etcd_tag")
  [[ $want == "$(echo "$have" | sort)" ]] || { say "kubeadm lists other images:"; echo "$want" >&2; exit 1; }
  # Import them into the node's containerd (content only, as kind does: unpacked on first use)
  # with a private containerd on this machine over the node's /var/lib/containerd.
  run=$(mktemp -d)
  printf 'version = 2\nroot = "%s"\nstate = "%s/state"\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "%s/sock"\n' \
    "$work/var/lib/containerd" "$run" "$run" >"$run/config.toml"
  containerd --config "$run/config.toml" >"$run/log" 2>&1 &
  cpid=$!
  for _ in $(seq 50); do [[ -S $run/sock ]] && break; sleep 0.2; done
  for i in "${node_images[@]}"; do
    ctr -a "$run/sock" -n k8s.io images import --all-platforms --no-unpack "$images/$i.tar" >/dev/null
  done
  ctr -a "$run/sock" -n k8s.io images ls -q >&2
  kill "$cpid"; wait "$cpid" 2>/dev/null || true
  rm -rf "$run"
  rm -rf "$work"/var/cache/apt/archives/*.deb "$work"/var/lib/apt/lists/* "$work"/var/log/*.log
  tar -C "$work" --numeric-owner -cf "$out.tmp" .
  mv "$out.tmp" "$out"
  rm -rf "$work"
fi
rm -rf "$stage"
say "done in $(( $(date +%s) - start ))s ($(du -h "$out" | cut -f1) node root filesystem)"
echo "$out"
