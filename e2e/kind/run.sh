#!/usr/bin/env bash
# The kind end-to-end suite: a kind cluster of a control plane and two workers, Multus (thick)
# and the whereabouts CNI at pinned versions, whereabouts' own cleanup turned off (the
# migration step in docs/operations/install.md), ipreclaim's image loaded with `kind load` and
# its chart installed, then the e2e scenarios (tests/e2e/, the same code the real node runs) against it.
# Timings are printed per step.
#
# Two ways, picked by whether a Docker engine answers:
#   - with Docker and internet (GitHub Actions: .github/workflows/e2e.yaml): kind from
#     `go install`, the kindest/node image of versions.env, Multus and whereabouts images from
#     their registries, ipreclaim's image from `docker build`;
#   - without (this project's machines, as root on Debian 12; or IPRECLAIM_KIND_LOCAL=1): no
#     registry at all. e2e/kind/node-image.sh builds the node image and every image from
#     sources; a Docker engine from Debian is started by hand with its own data root and no
#     firewall changes (local.sh), kind is built from its Go module with
#     kind-unprivileged.patch (this machine refuses --privileged), the pod network is Debian's
#     bridge plugin (containerd's CNI template with each node's pod CIDR) with routes between
#     the nodes instead of kindnetd (not served by the Go module proxy), ipreclaim's image comes
#     from scripts/image.sh (the Dockerfile with buildah). The engine, its containers, networks
#     and bridges are removed at exit, after a failure too, and a killed run's at the next start.
# Usage: e2e/kind/run.sh [--keep] [more cargo test filters]   (--keep leaves the cluster up)
#        e2e/kind/run.sh --prepare   only what the run builds of its own (kind, and here the node
#                                    image): no engine, no cluster; scripts/test.sh --kind runs
#                                    it in the background while the tests run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cluster=ipreclaim-e2e
keep=false
prepare=false
while [[ ${1:-} == --keep || ${1:-} == --prepare ]]; do
  case $1 in
    --keep) keep=true ;;
    --prepare) prepare=true ;;
  esac
  shift
done

start=$(date +%s)
step_start=$start
step_name=""
step() { # prints how long the previous step took, then names the next
  local now
  now=$(date +%s)
  [[ -z $step_name ]] || echo "-- $step_name: $((now - step_start)) s" >&2
  step_name=$1 step_start=$now
  [[ $1 == finished ]] || echo "== $1" >&2
}

need() { command -v "$1" >/dev/null || { echo "missing $1: $2" >&2; exit 1; }; }
need go "install Go"
local_mode=false
if [[ ${IPRECLAIM_KIND_LOCAL:-} == 1 ]] || ! docker info >/dev/null 2>&1; then local_mode=true; fi

step "tools (kubectl, helm from their Go modules; kind)"
bin=$("$root/scripts/setup.sh" | tail -n 1)
export PATH="$bin:$HOME/go/bin:$PATH"
if $local_mode; then
  # shellcheck source=local.sh
  source "$here/local.sh"
  kind=$(kind_local_build)
else
  need docker "install Docker"
  command -v kind >/dev/null || go install "sigs.k8s.io/kind@$KIND_VERSION"
  kind=kind
fi

# The scenarios' test binary. Not quite what scripts/test.sh's `cargo test --workspace` built:
# with --test e2e alone cargo builds ipreclaim and testenv again (about 2 minutes), so
# --prepare builds it too.
scenarios=(cargo test --workspace --locked --features ipreclaim/root-tests --test e2e)
if $prepare; then
  if $local_mode; then
    step "node image and the suite's images from sources (node-image.sh; cached)"
    "$here/node-image.sh" >/dev/null
  fi
  step "the scenarios' test binary (${scenarios[*]} --no-run)"
  (cd "$root" && "${scenarios[@]}" --no-run)
  step finished
  echo "e2e/kind/run.sh --prepare: done in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s" >&2
  exit 0
fi

kubeconfig=$(mktemp)
manifests=$(mktemp -d)
cleanup() {
  local rc=$?
  if ! $keep; then
    "$kind" delete cluster --name "$cluster" >/dev/null 2>&1 || true
    if $local_mode; then dockerd_stop; fi
  fi
  if $keep; then
    # Only what the run got to start: a failure before the engine or the cluster keeps less.
    local engine=""
    if $local_mode && [[ -n ${DOCKER_HOST:-} ]]; then engine=" DOCKER_HOST=$DOCKER_HOST"; fi
    if [[ -s $kubeconfig ]]; then
      echo "kept: KUBECONFIG=$kubeconfig$engine (e2e/kind/run.sh again removes it)" >&2
    else
      rm -f "$kubeconfig"
      if [[ -n $engine ]]; then
        echo "kept: no cluster;$engine (e2e/kind/run.sh again removes it)" >&2
      else
        echo "kept: nothing (the run stopped before the cluster was created)" >&2
      fi
    fi
  else
    rm -f "$kubeconfig"
  fi
  rm -rf "$manifests"
  echo "e2e/kind/run.sh: $([[ $rc == 0 ]] && echo passed || echo "FAILED ($rc)") in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s" >&2
}
trap cleanup EXIT
trap 'exit 130' INT TERM

config=$here/cluster.yaml
node_image=$KIND_NODE_IMAGE
pod_image=registry.k8s.io/pause:3.10
if $local_mode; then
  step "node image and the suite's images from sources (node-image.sh; cached)"
  node_tar=$("$here/node-image.sh" | tail -n 1)
  images=$(dirname "$node_tar")/images
  pod_image=registry.k8s.io/pause:$(sed -n 's/.*sandbox_image = ".*pause:\(.*\)"/\1/p' <(tar -xOf "$node_tar" ./etc/containerd/config.toml))
  # IPRECLAIM_KIND_IMAGE_ARCHIVE: an archive scripts/image.sh saved earlier (of
  # localhost/ipreclaim/ipreclaim:e2e-amd64), to skip the build while iterating.
  image_archive=${IPRECLAIM_KIND_IMAGE_ARCHIVE:-$root/target/image-oci/ipreclaim-amd64.tar}
  if [[ -z ${IPRECLAIM_KIND_IMAGE_ARCHIVE:-} ]]; then
    step "ipreclaim's image from the Dockerfile (scripts/image.sh amd64; cached layers)"
    IMAGE=localhost/ipreclaim/ipreclaim:e2e "$root/scripts/image.sh" amd64 >&2
  fi
  step "Docker engine, started by hand (local.sh)"
  dockerd_start
  node_image=ipreclaim.local/kind-node:$(basename "$node_tar" .tar | sed 's/^node-//')
  if ! docker image inspect "$node_image" >/dev/null 2>&1; then
    # kind's base image settings (images/base/Dockerfile), with the unprivileged entrypoint;
    # STOPSIGNAL in a metadata-only build (docker 20.10's import takes no STOPSIGNAL).
    docker import --change 'ENV container=docker' \
      --change 'ENTRYPOINT ["/usr/local/bin/entrypoint-unprivileged", "/sbin/init"]' \
      "$node_tar" "$node_image-rootfs" >/dev/null
    printf 'FROM %s\nSTOPSIGNAL SIGRTMIN+3\n' "$node_image-rootfs" | docker build -q -t "$node_image" - >/dev/null
    docker rmi "$node_image-rootfs" >/dev/null
  fi
  # Node images of earlier builds.
  docker images --format '{{.Repository}}:{{.Tag}}' ipreclaim.local/kind-node | grep -vxF "$node_image" | xargs -r docker rmi >/dev/null || true
  config=$here/cluster-local.yaml
fi

step "kind create cluster ($node_image; $(grep -c 'role:' "$config") nodes)"
if $local_mode; then
  # No default CNI yet: the nodes become Ready once the routes below are in.
  "$kind" create cluster --name "$cluster" --image "$node_image" --config "$config" --kubeconfig "$kubeconfig"
else
  "$kind" create cluster --name "$cluster" --image "$node_image" --config "$config" --kubeconfig "$kubeconfig" --wait 120s
fi
export KUBECONFIG=$kubeconfig

if $local_mode; then
  step "pod network: each node's pod CIDR routed to it from the others"
  nodes=$("$kind" get nodes --name "$cluster")
  for n in $nodes; do
    for _ in $(seq 60); do
      [[ -n $(kubectl get node "$n" -o jsonpath='{.spec.podCIDR}' 2>/dev/null) ]] && break
      sleep 1
    done
  done
  for n in $nodes; do
    cidr=$(kubectl get node "$n" -o jsonpath='{.spec.podCIDR}')
    ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$n")
    [[ -n $cidr && -n $ip ]] || { echo "no pod CIDR or address for $n" >&2; exit 1; }
    for m in $nodes; do
      [[ $m == "$n" ]] || docker exec "$m" ip route replace "$cidr" via "$ip"
    done
  done
  kubectl wait --for=condition=Ready nodes --all --timeout=180s
  kubectl -n kube-system rollout status deployment/coredns --timeout=180s
fi
kubectl get nodes -o wide

step "Multus $MULTUS_VERSION, whereabouts $WHEREABOUTS_VERSION"
# Their manifests from the pinned release sources in ../shared/third_party when that is there
# (a machine without internet), else from the release tags on GitHub.
third_party=${IPRECLAIM_THIRD_PARTY:-$root/../shared/third_party}
if [[ -f $third_party/multus-cni-$MULTUS_VERSION.tar.gz && -f $third_party/whereabouts-$WHEREABOUTS_VERSION.tar.gz ]]; then
  tar -xzf "$third_party/multus-cni-$MULTUS_VERSION.tar.gz" -C "$manifests"
  tar -xzf "$third_party/whereabouts-$WHEREABOUTS_VERSION.tar.gz" -C "$manifests"
  multus="$manifests/multus-cni-$MULTUS_VERSION/deployments"
  wa="$manifests/whereabouts-$WHEREABOUTS_VERSION/doc/crds"
else
  multus="https://raw.githubusercontent.com/k8snetworkplumbingwg/multus-cni/$MULTUS_VERSION/deployments"
  wa="https://raw.githubusercontent.com/k8snetworkplumbingwg/whereabouts/$WHEREABOUTS_VERSION/doc/crds"
fi
multus_image=ghcr.io/k8snetworkplumbingwg/multus-cni:$MULTUS_VERSION-thick
wa_image=ghcr.io/k8snetworkplumbingwg/whereabouts:$WHEREABOUTS_VERSION
if $local_mode; then
  # Their images as built from those sources by node-image.sh, loaded into every node.
  for i in "$multus_image" "$wa_image"; do
    "$kind" load image-archive --name "$cluster" "$images/$(echo "${i#*/}" | tr '/:' '__').tar"
  done
fi
# The manifests name moving tags (snapshot-thick, latest): pin them to the release's image.
kubectl apply -f "$multus/multus-daemonset-thick.yml"
kubectl -n kube-system set image daemonset/kube-multus-ds "kube-multus=$multus_image" "install-multus-binary=$multus_image"
# Multus thick runs every delegate plugin (whereabouts, macvlan) in its daemon's container,
# which the manifest limits to 100m of CPU and 50Mi: on a busy 2-core machine the whereabouts
# processes of a node's CNI calls then share a tenth of a core, their 1 s Lease with the
# apiserver lapses, and ADDs and DELs time out and pile up ("client rate limiter Wait
# returned an error: context deadline exceeded"; seen on a worker right after its return,
# where the kubelet's stops and the replacements' starts come together). The requests kept,
# no CPU limit, memory up to 1Gi.
kubectl -n kube-system patch daemonset kube-multus-ds --type=json \
  -p '[{"op":"replace","path":"/spec/template/spec/containers/0/resources","value":{"requests":{"cpu":"100m","memory":"50Mi"},"limits":{"memory":"1Gi"}}}]'
# whereabouts as its v0.9 install has it: the CRDs, the DaemonSet (CNI install, token watcher
# and ip-control-loop) and the reconciler Deployment.
kubectl apply -f "$wa/whereabouts.cni.cncf.io_ippools.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml" \
  -f "$wa/whereabouts.cni.cncf.io_nodeslicepools.yaml" \
  -f "$wa/daemonset-install.yaml" \
  -f "$wa/reconciler-deployment.yaml"
kubectl -n kube-system set image daemonset/whereabouts "whereabouts=$wa_image"
kubectl -n kube-system set image deployment/whereabouts-reconciler "whereabouts-reconciler=$wa_image"
if $local_mode; then
  for o in daemonset/kube-multus-ds daemonset/whereabouts deployment/whereabouts-reconciler; do
    kubectl -n kube-system patch "$o" --type=json -p '[{"op":"add","path":"/spec/template/spec/containers/0/imagePullPolicy","value":"Never"}]'
  done
fi

step "migration (README: Migrating from whereabouts' ip-control-loop and ip-reconciler)"
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

step "ipreclaim image (kind load) and chart"
# --skip-crds below keeps whereabouts' own CRDs; ipreclaim's fence records need its one CRD.
kubectl apply -f "$root/crds/ipfences.ipreclaim.io.yaml"
if $local_mode; then
  repo=localhost/ipreclaim/ipreclaim tag=e2e-amd64
  "$kind" load image-archive --name "$cluster" "$image_archive"
else
  repo=ipreclaim tag=e2e
  docker build -t "$repo:$tag" "$root"
  "$kind" load docker-image "$repo:$tag" --name "$cluster"
fi
helm install ipreclaim "$root/charts/ipreclaim" --namespace ipreclaim --create-namespace \
  --skip-crds \
  --set image.repository="$repo" --set image.tag="$tag" --set image.pullPolicy=Never \
  --set controller.leakGrace=5s --set controller.sweepInterval=5s \
  --set nodeAgent.sandboxGrace=5s \
  --wait --timeout 300s
kubectl -n ipreclaim get pods -o wide

step "scenarios (${scenarios[*]} -- ::cluster $*)"
cd "$root"
# IPRECLAIM_KIND(_CLUSTER): a scenario loads a test image with `kind load`. --workspace: the
# features scripts/test.sh's `cargo test --workspace` builds with (tokio's test-util among
# them); the binary itself is built by --prepare (scripts/test.sh --kind: beside the tests).
IPRECLAIM_E2E=kind IPRECLAIM_E2E_NAMESPACE=ipreclaim IPRECLAIM_E2E_POD_IMAGE=$pod_image \
  IPRECLAIM_KIND=$kind IPRECLAIM_KIND_CLUSTER=$cluster \
  "${scenarios[@]}" -- --test-threads=1 ::cluster "$@"

step "Events"
kubectl get events -A --field-selector reason=IPAddressGarbageCollected
step finished
