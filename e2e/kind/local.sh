# Sourced by e2e/kind/run.sh on a machine without a running Docker engine and without a
# registry (this project's development and CI machines, as root on Debian 12):
#   kind_local_build   kind from its Go module with kind-unprivileged.patch (its nodes run
#                      without --privileged, which this machine refuses: no CAP_SYS_RESOURCE in
#                      the capability bounding set); prints the binary
#   dockerd_start      Debian's docker.io engine started by hand with its own data root, socket
#                      and bridge, and nothing of the host's firewall or forwarding touched
#                      (--iptables=false --ip6tables=false --ip-forward=false --ip-masq=false;
#                      another kubelet may run on this host); exports DOCKER_HOST. Leftovers of a
#                      killed run (its engine, containers, networks, bridges) go first.
#   dockerd_stop       the kind containers, volumes and networks removed, the engine stopped,
#                      its bridges (ipreclaim-d0, ipreclaim-kind) deleted, the kernel sysctls
#                      the nodes' kubelets set put back (run.sh's exit trap; also after a
#                      failure or Ctrl-C; a killed run's at the next start)
# shellcheck shell=bash
kind_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kind_cache=${IPRECLAIM_CACHE:-$HOME/.cache/ipreclaim}/kind
docker_root=${IPRECLAIM_KIND_DOCKER_ROOT:-/var/lib/ipreclaim-kind}
docker_sock=$docker_root/docker.sock
docker_pidfile=$docker_root/docker.pid
# The kernel is the host's: each kind node's kubelet sets these on it (as testenv's
# KUBELET_SYSCTLS). Their values before the first node, kept until put back.
kubelet_sysctls=(vm.overcommit_memory kernel.panic kernel.panic_on_oops)
sysctls_saved=$docker_root/sysctls.saved

sysctls_save() {
  [[ -f $sysctls_saved ]] && return
  local k
  for k in "${kubelet_sysctls[@]}"; do echo "$k=$(sysctl -n "$k")"; done >"$sysctls_saved.tmp"
  mv "$sysctls_saved.tmp" "$sysctls_saved"
}

sysctls_restore() {
  [[ -f $sysctls_saved ]] || return 0
  local kv
  while read -r kv; do sysctl -qw "$kv" || true; done <"$sysctls_saved"
  rm -f "$sysctls_saved"
}

kind_local_build() {
  local patch=$kind_dir/kind-unprivileged.patch sum out src
  sum=$(sha256sum "$patch" | cut -c1-12)
  out=$kind_cache/bin/kind-$KIND_VERSION-unprivileged-$sum
  # Called as $(kind_local_build), where errexit is off: each step returns on failure, so
  # that run.sh stops here instead of going on with a kind binary that is not there.
  if [[ ! -x $out ]]; then
    echo "== kind $KIND_VERSION from its Go module, with kind-unprivileged.patch" >&2
    mkdir -p "$kind_cache/bin" || return 1
    src=$(cd "$kind_cache" && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
    [[ -n $src && -d $src ]] || { echo "kind: go mod download sigs.k8s.io/kind@$KIND_VERSION failed" >&2; return 1; }
    rm -rf "$kind_cache/src-kind"
    cp -r "$src" "$kind_cache/src-kind" && chmod -R u+w "$kind_cache/src-kind" || return 1
    (cd "$kind_cache/src-kind" && patch -p1 --quiet <"$patch" &&
      CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" .) || return 1
    mv "$out.tmp" "$out" || return 1
    rm -rf "$kind_cache/src-kind"
  fi
  echo "$out"
}

# Bridges of this engine, by name: its default bridge and kind's network, which dockerd_start
# makes before kind does (kind uses an existing "kind" network), so that nothing of another
# engine on this host is touched.
dockerd_bridges() { ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -xE 'ipreclaim-d0|ipreclaim-kind' || true; }

# Every container, volume and network of this engine (it is this suite's alone); images stay.
dockerd_clear() {
  local ids
  mapfile -t ids < <(DOCKER_HOST=unix://$docker_sock docker ps -aq)
  ((${#ids[@]} == 0)) || DOCKER_HOST=unix://$docker_sock docker rm -f -v "${ids[@]}" >/dev/null 2>&1 || true
  DOCKER_HOST=unix://$docker_sock docker volume prune -f >/dev/null 2>&1 || true
  DOCKER_HOST=unix://$docker_sock docker network prune -f >/dev/null 2>&1 || true
}

dockerd_stop() {
  if [[ -S $docker_sock ]] && DOCKER_HOST=unix://$docker_sock timeout 10 docker info >/dev/null 2>&1; then
    dockerd_clear
  fi
  local pid
  pid=$(cat "$docker_pidfile" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$docker_pidfile" "$docker_sock"
  # Only the bridges this engine made.
  local b
  for b in $(dockerd_bridges); do ip link delete "$b" 2>/dev/null || true; done
  # Its mounts (overlay layers, the exec root) if it died without cleaning up.
  { grep -oE " $docker_root/[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  # Its nodes' kubelets are gone: the kernel as it was before them.
  sysctls_restore
}

dockerd_start() {
  dpkg -s docker.io >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
  mkdir -p "$docker_root"
  # A killed run's engine and everything it made, first (its sysctls put back too).
  dockerd_stop
  sysctls_save
  echo "== dockerd (data root $docker_root; no iptables, no forwarding changes)" >&2
  ip link add ipreclaim-d0 type bridge
  ip addr add 10.250.0.1/24 dev ipreclaim-d0
  ip link set ipreclaim-d0 up
  dockerd --data-root "$docker_root/data" --exec-root "$docker_root/exec" -H "unix://$docker_sock" \
    --pidfile "$docker_pidfile" --bridge ipreclaim-d0 \
    --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --log-level warn >"$docker_root/dockerd.log" 2>&1 &
  export DOCKER_HOST=unix://$docker_sock
  local up=false
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && up=true && break; sleep 0.5; done
  if ! $up; then
    tail -n 20 "$docker_root/dockerd.log" >&2
    echo "dockerd did not start" >&2
    return 1
  fi
  # A killed run's containers come back with the engine: gone before kind starts.
  dockerd_clear
  docker network create -d bridge -o com.docker.network.bridge.name=ipreclaim-kind kind >/dev/null
}
