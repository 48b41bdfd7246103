#!/usr/bin/env bash
# Checks a built ipreclaim image the way an image scanner or an admission policy would look at
# it, from buildah's local storage (as root):
#   - the OCI labels (title, description, licenses, source, url, version, revision, created,
#     base.name) are set, and version is the one asked for;
#   - it runs as a non-root user (65532) and its entrypoint is /usr/local/bin/ipreclaim;
#   - no shell and no package manager in it;
#   - the binary is for the image's architecture and carries `cargo auditable`'s dependency
#     list (the .dep-v0 section, zlib-compressed JSON naming ipreclaim and its crates);
#   - the binary starts and answers --version, and both programs (`controller`, `node-agent`)
#     answer --help, as the image's user (amd64: in the image with `buildah run`; arm64: with
#     qemu-aarch64-static from Debian on the image's own loader and libc, when it is installed);
#   - its size, printed.
# Usage: scripts/image-check.sh IMAGE ARCH [VERSION [REVISION]]   (exit 1 with every failed
#        check listed)
set -euo pipefail
image=$1 arch=$2 want_version=${3:-} want_revision=${4:-}
failed=()
ok() { echo "image-check: ok   $*"; }
bad() { echo "image-check: FAIL $*" >&2; failed+=("$*"); }
fmt() { buildah inspect --type image --format "$1" "$image"; }

buildah inspect --type image "$image" >/dev/null || { echo "image-check: no image $image" >&2; exit 1; }

image_arch=$(fmt '{{.OCIv1.Architecture}}')
if [[ $image_arch == "$arch" ]]; then ok "architecture $image_arch"; else bad "architecture $image_arch, wanted $arch"; fi

for label in title description licenses source url version revision created base.name; do
  value=$(fmt "{{index .OCIv1.Config.Labels \"org.opencontainers.image.$label\"}}")
  if [[ -n $value && $value != "<no value>" && $value != unknown ]]; then
    ok "label org.opencontainers.image.$label=$value"
  else
    bad "label org.opencontainers.image.$label missing or unknown ($value)"
  fi
done
if [[ -n $want_version ]]; then
  v=$(fmt '{{index .OCIv1.Config.Labels "org.opencontainers.image.version"}}')
  [[ $v == "$want_version" ]] || bad "label version $v, wanted $want_version"
fi
if [[ -n ${want_revision:-} ]]; then
  v=$(fmt '{{index .OCIv1.Config.Labels "org.opencontainers.image.revision"}}')
  [[ $v == "$want_revision" ]] || bad "label revision $v, wanted $want_revision"
fi

user=$(fmt '{{.OCIv1.Config.User}}')
case ${user%%:*} in
  "" | 0 | root) bad "runs as root (User=\"$user\")" ;;
  *) ok "user $user (non-root)" ;;
esac
entrypoint=$(fmt '{{.OCIv1.Config.Entrypoint}}')
if [[ $entrypoint == '[/usr/local/bin/ipreclaim]' ]]; then ok "entrypoint $entrypoint"; else bad "entrypoint $entrypoint"; fi

ctr=$(buildah from --quiet --pull=never "$image")
tmp=$(mktemp -d)
cleanup() { buildah umount "$ctr" >/dev/null 2>&1 || true; buildah rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
mnt=$(buildah mount "$ctr")
bin=$mnt/usr/local/bin/ipreclaim
[[ -x $bin ]] || { bad "no executable /usr/local/bin/ipreclaim"; }

found=()
for f in bin/sh bin/bash usr/bin/sh bin/busybox usr/bin/apt usr/bin/dpkg; do
  [[ -e $mnt/$f || -L $mnt/$f ]] && found+=("/$f")
done
if ((${#found[@]})); then bad "in the image: ${found[*]}"; else ok "no shell, no package manager"; fi

if [[ -x $bin ]]; then
  machine=$(readelf -h "$bin" | sed -n 's/^ *Machine: *//p')
  case $arch/$machine in
    amd64/*X86-64* | arm64/AArch64) ok "binary machine: $machine" ;;
    *) bad "binary machine $machine for $arch" ;;
  esac
  # Its loader (ELF interpreter) is in the image and of the same architecture: the runtime base
  # matches the binary. Links are followed inside the image.
  interp=$(readelf -l "$bin" | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p')
  path=$interp
  for _ in 1 2 3 4 5 6 7 8; do
    [[ -L $mnt$path ]] || break
    link=$(readlink "$mnt$path")
    if [[ $link == /* ]]; then path=$link; else path=$(dirname "$path")/$link; fi
  done
  loader_machine=$(readelf -h "$mnt$path" 2>/dev/null | sed -n 's/^ *Machine: *//p') || true
  if [[ -n $interp && $loader_machine == "$machine" ]]; then
    ok "loader $interp in the image ($loader_machine)"
  else
    bad "loader ${interp:-none} not in the image for $machine (found: ${loader_machine:-nothing} at $path)"
  fi
  # cargo auditable: section .dep-v0, zlib-compressed JSON of the dependency tree.
  read -r offset size < <(readelf -S -W "$bin" | awk '$2 == ".dep-v0" { print $5, $6 }') || true
  if [[ -n ${offset:-} ]]; then
    deps=$(python3 -c '
import json, sys, zlib
with open(sys.argv[1], "rb") as f:
    f.seek(int(sys.argv[2], 16)); data = f.read(int(sys.argv[3], 16))
packages = json.loads(zlib.decompress(data))["packages"]
names = {p["name"] for p in packages}
print(len(packages), "ipreclaim" in names, "kube-client" in names)' "$bin" "$offset" "$size")
    read -r count has_self has_kube <<<"$deps"
    if [[ $has_self == True && $has_kube == True ]]; then
      ok "cargo auditable section .dep-v0: $count packages"
    else
      bad "cargo auditable section lists $count packages without ipreclaim or kube-client"
    fi
  else
    bad "no .dep-v0 section (cargo auditable)"
  fi

  run_version=()
  if [[ $arch == amd64 && $(dpkg --print-architecture) == amd64 ]]; then
    run_version=(buildah run --isolation chroot "$ctr" --)
    prefix=""
  elif command -v qemu-aarch64-static >/dev/null && [[ $arch == arm64 ]]; then
    # A copy of the image's files (buildah's storage is root-only) that the image's user reads.
    chmod 755 "$tmp"
    cp -a "$mnt/." "$tmp/rootfs"
    prefix=$tmp/rootfs
    run_version=(setpriv --reuid="${user%%:*}" --regid="${user##*:}" --clear-groups qemu-aarch64-static -L "$prefix")
  fi
  if ((${#run_version[@]})); then
    # The version is the binary's (`ipreclaim --version`); each program parses its flags.
    if out=$("${run_version[@]}" "$prefix/usr/local/bin/ipreclaim" --version 2>&1) && [[ $out == ipreclaim\ * ]]; then
      ok "ipreclaim --version: $out"
    else
      bad "ipreclaim --version failed: $out"
    fi
    for program in controller node-agent; do
      if out=$("${run_version[@]}" "$prefix/usr/local/bin/ipreclaim" "$program" --help 2>&1); then
        ok "ipreclaim $program --help: $(echo "$out" | grep -m 1 .)"
      else
        bad "ipreclaim $program --help failed: $out"
      fi
    done
  else
    echo "image-check: skip --version of $arch (no way to run it here: apt-get install qemu-user-static)"
  fi
fi

# sed reads the whole list: head would stop reading, and buildah's SIGPIPE fail the script (pipefail)
size=$(buildah images --format '{{.Size}}' "$image" | sed -n 1p)
echo "image-check: size $size ($image, $arch)"
if ((${#failed[@]})); then
  echo "image-check: ${#failed[@]} failed" >&2
  exit 1
fi
echo "image-check: $image passed"
