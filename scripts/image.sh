#!/usr/bin/env bash
# Builds ipreclaim's image from the project's own Dockerfile on a machine without a registry or
# a Docker engine (as root; Debian): buildah (`--isolation chroot`) on stand-in base images made
# here and named as the Dockerfile names them, then checks the image as a scanner would
# (scripts/image-check.sh). Nothing is pulled: the bases come from Debian's packages and the
# Rust toolchain already installed with rustup.
#
#   docker.io/library/rust:<RUST_VERSION>-bookworm   the build stage: a debootstrap bookworm
#       rootfs (gcc, libc6-dev, git, curl, ca-certificates, pkg-config), rustup and the installed
#       <RUST_VERSION> toolchain under /usr/local/{cargo,rustup} as the official image has them,
#       plus the aarch64-unknown-linux-gnu standard library compiled here by that same compiler
#       from Debian's rust-src of the same version (so the Dockerfile's `rustup target add`
#       finds it installed instead of downloading it);
#   gcr.io/distroless/cc-debian12:nonroot   the runtime stage, one image per architecture (the
#       name points at the one being built): Debian bookworm's libc6 and libgcc-s1 of that
#       architecture, the CA bundle, /etc/passwd with nonroot (65532), /home/nonroot, /tmp, and
#       dpkg status.d records for scanners; user 65532.
#
# Usage: scripts/image.sh [amd64|arm64|all]   (default amd64; a second run waits for the first)
# Env:   IMAGE (default ipreclaim:<version>): the image of ARCH is tagged IMAGE-ARCH (amd64 also
#        IMAGE) and saved as $OUT/ipreclaim-ARCH.tar, a docker-archive of that name that
#        `ctr images import` and `kind load image-archive` take; OUT (default target/image-oci);
#        VERSION (default the crate's).
# Bases and build logs are kept in ~/.cache/ipreclaim/image-bases/ ($IPRECLAIM_CACHE; delete it
# to make them again).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
say() { echo "image: $*" >&2; }
minutes() { echo "$(( ($(date +%s) - $1 + 30) / 60 )) min ($(( $(date +%s) - $1 ))s)"; }

if [[ $(id -u) -ne 0 ]]; then
  echo "scripts/image.sh: buildah --isolation chroot and debootstrap need root" >&2
  exit 1
fi
arches=${1:-amd64}
[[ $arches == all ]] && arches="amd64 arm64"
for a in $arches; do
  [[ $a == amd64 || $a == arm64 ]] || { echo "scripts/image.sh: unknown arch $a (amd64, arm64, all)" >&2; exit 2; }
done
[[ $(dpkg --print-architecture) == amd64 ]] || { echo "scripts/image.sh: the stand-in bases are made for an amd64 build machine" >&2; exit 1; }

install_missing() {
  local p missing=()
  for p in "$@"; do
    [[ $p == --* ]] || dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  say "installing ${missing[*]}"
  local opts=(-y -qq)
  [[ $1 == --no-install-recommends ]] && opts+=("$1")
  DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "${missing[@]}" >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install "${opts[@]}" "${missing[@]}" >/dev/null; }
}
install_missing buildah debootstrap binutils
# image-check.sh runs the arm64 binary's --version with qemu-user-static, called by name: no
# binfmt registration (binfmt-support, a recommends, is left out).
if [[ " $arches " == *" arm64 "* ]]; then install_missing --no-install-recommends qemu-user-static; fi

# The names and versions the Dockerfile uses (its ARG defaults).
arg() { sed -n "s/^ARG $1=//p" Dockerfile | head -n 1; }
rust_version=$(arg RUST_VERSION)
build_base=$(arg BUILD_BASE | sed "s/\${RUST_VERSION}/$rust_version/")
runtime_base=$(arg RUNTIME_BASE)
[[ -n $rust_version && -n $build_base && -n $runtime_base ]] ||
  { echo "scripts/image.sh: Dockerfile lacks ARG RUST_VERSION, BUILD_BASE or RUNTIME_BASE" >&2; exit 1; }
version=${VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)}
image=${IMAGE:-ipreclaim:$version}
out=${OUT:-$root/target/image-oci}
# Outside the work tree, like the Go-built binaries (a fresh clone on the same machine reuses
# the bases, and so buildah's cached layers).
cache=${IPRECLAIM_CACHE:-$HOME/.cache/ipreclaim}/image-bases
mkdir -p "$cache" "$out"

# --- Debian packages through apt's own client, with private lists (the host's apt is untouched)
aptdir=$cache/apt
apt_opts=(-o "Dir::Etc::SourceList=$aptdir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
  -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache"
  -o APT::Architectures::=amd64 -o APT::Architectures::=arm64 -o Debug::NoLocking=1)
apt_ready() {
  [[ -f $aptdir/updated ]] && return
  mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
  local key=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb [signed-by=$key] http://deb.debian.org/debian bookworm main"
    echo "deb [signed-by=$key] http://deb.debian.org/debian bookworm-updates main"
    echo "deb [signed-by=$key] http://deb.debian.org/debian-security bookworm-security main"
    # rust-src of newer Rust releases (the aarch64 standard library's source)
    echo "deb [signed-by=$key] http://deb.debian.org/debian trixie-backports main"
  } >"$aptdir/sources.list"
  apt-get "${apt_opts[@]}" update -qq
  touch "$aptdir/updated"
}
# Downloads package $1 (name[:arch][=version]) into $2; prints the .deb's path.
apt_download() {
  apt_ready
  mkdir -p "$2"
  (cd "$2" && apt-get "${apt_opts[@]}" download -qq "$1" 2>/dev/null >&2) ||
    { echo "scripts/image.sh: apt-get download $1 failed" >&2; exit 1; }
  local name=${1%%[:=]*} arch=${1#*:}
  [[ $1 == *:* ]] || arch=
  arch=${arch%%=*}
  local f newest=""
  for f in "$2/${name}_"*"_${arch:-all}.deb" "$2/${name}_"*_all.deb; do
    [[ -f $f && ( -z $newest || $f -nt $newest ) ]] && newest=$f
  done
  echo "$newest"
}

have_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# --- the build stage's base ------------------------------------------------------------------
rootfs=$cache/rootfs-bookworm-amd64
if [[ ! -f $rootfs.done ]]; then
  say "debootstrap bookworm (build stage rootfs)"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates,curl,git,gcc,libc6-dev,make,pkg-config,xz-utils \
    bookworm "$rootfs" http://deb.debian.org/debian >"$cache/debootstrap.log" 2>&1 ||
    { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  date -u +%FT%TZ >"$rootfs.done"
fi

# The installed toolchain of RUST_VERSION (rustup's), copied without its docs.
toolchain_triple=x86_64-unknown-linux-gnu
rustc_version=""
src_tc=""
for name in $(rustup toolchain list | awk '{print $1}'); do
  v=$(rustup run "$name" rustc --version 2>/dev/null | awk '{print $2}')
  # A release only (not 1.95.0-nightly).
  if [[ $v == "$rust_version" || $v == "$rust_version".* ]] && [[ $v != *-* ]]; then
    src_tc=$(rustup run "$name" rustc --print sysroot)
    rustc_version=$v
    break
  fi
done
[[ -n $src_tc ]] || { echo "scripts/image.sh: no installed rustup toolchain is Rust $rust_version (rustup toolchain list)" >&2; exit 1; }
tc=$cache/toolchain/$rustc_version-$toolchain_triple
if [[ ! -f $tc.done ]]; then
  say "toolchain $rustc_version from $src_tc"
  rm -rf "$tc"
  mkdir -p "$tc"
  cp -a "$src_tc/." "$tc/"
  rm -rf "$tc/share/doc" "$tc"/lib/rustlib/manifest-rust-docs-*
  # rust-docs is gone: drop it from rustup's record of the toolchain's components.
  sed -i '/^rust-docs-/d' "$tc/lib/rustlib/components"
  awk 'BEGIN { RS = ""; ORS = "\n\n" } !/pkg = "rust-docs"/' "$tc/lib/rustlib/multirust-config.toml" >"$tc/mc" &&
    mv "$tc/mc" "$tc/lib/rustlib/multirust-config.toml"
  echo "$rustc_version" >"$tc.done"
fi

# The aarch64 standard library: Debian's rust-src of the same version, compiled by this
# toolchain (-Zbuild-std), installed as rustup's rust-std component would be.
std_target=aarch64-unknown-linux-gnu
if [[ ! -f $tc.$std_target.done ]]; then
  apt_ready
  debver=$(apt-cache "${apt_opts[@]}" madison rust-src | awk -F'|' '{gsub(/ /, "", $2); print $2}' |
    grep -E "^${rustc_version//./\\.}\+" | head -n 1)
  [[ -n $debver ]] || { echo "scripts/image.sh: Debian has no rust-src $rustc_version" >&2; exit 1; }
  say "aarch64 standard library from Debian's rust-src $debver"
  deb=$(apt_download "rust-src=$debver" "$cache/debs")
  src=$cache/rust-src-$rustc_version
  rm -rf "$src" && mkdir -p "$src"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$src" "./usr/src/rustc-${rustc_version}/library"
  mkdir -p "$tc/lib/rustlib/src/rust"
  rm -rf "$tc/lib/rustlib/src/rust/library"
  ln -s "$src/usr/src/rustc-${rustc_version}/library" "$tc/lib/rustlib/src/rust/library"
  work=$cache/std-$std_target
  rm -rf "$work" && mkdir -p "$work/src"
  printf '[package]\nname = "sysroot"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n' >"$work/Cargo.toml"
  echo '#![no_std]' >"$work/src/lib.rs"
  # With bitcode, as rustup's rust-std is: the release profile's fat LTO needs it in std too
  # ("failed to get bitcode from object file for LTO" otherwise).
  (cd "$work" && env -u RUSTUP_TOOLCHAIN -u CARGO_BUILD_TARGET PATH="$tc/bin:$PATH" RUSTC="$tc/bin/rustc" \
    RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$work/target" RUSTFLAGS="-Cembed-bitcode=yes" \
    "$tc/bin/cargo" build --release -Zbuild-std=std,panic_abort,panic_unwind --target "$std_target") \
    >"$cache/std-$std_target.log" 2>&1 || { tail -n 30 "$cache/std-$std_target.log" >&2; exit 1; }
  rm -rf "$tc/lib/rustlib/src" "$tc/lib/rustlib/$std_target"
  mkdir -p "$tc/lib/rustlib/$std_target/lib"
  cp "$work/target/$std_target/release/deps/"*.rlib "$tc/lib/rustlib/$std_target/lib/"
  (cd "$tc" && find "lib/rustlib/$std_target" -type f | sort | sed 's/^/file:/') >"$tc/lib/rustlib/manifest-rust-std-$std_target"
  { grep -v "^rust-std-$std_target\$" "$tc/lib/rustlib/components"; echo "rust-std-$std_target"; } >"$tc/c" &&
    mv "$tc/c" "$tc/lib/rustlib/components"
  grep -q "target = \"$std_target\"" "$tc/lib/rustlib/multirust-config.toml" ||
    printf '\n[[components]]\npkg = "rust-std"\ntarget = "%s"\nis_extension = false\n' "$std_target" \
      >>"$tc/lib/rustlib/multirust-config.toml"
  rm -rf "$work"
  # What the build base is made of: the rlibs themselves.
  { echo "$debver"; cat "$tc/lib/rustlib/$std_target/lib/"*.rlib | sha256sum; } >"$tc.$std_target.done"
fi

# The build machine's own CAs (e.g. a TLS-inspecting proxy's, in /usr/local/share/ca-certificates)
# are trusted in the build stage as on the host: `cargo install` and apt reach their registries
# through it. The runtime base keeps Debian's bundle only.
local_cas=(/usr/local/share/ca-certificates/*.crt)
[[ -e ${local_cas[0]} ]] || local_cas=()
build_base_key=$(cat "$rootfs.done" "$tc.done" "$tc.$std_target.done" "${local_cas[@]}" | sha256sum | cut -c1-16)
if ! have_image "$build_base" || [[ $(cat "$cache/build-base.done" 2>/dev/null) != "$build_base_key" ]]; then
  say "committing $build_base"
  ctr=$(buildah from --quiet scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$rootfs/." "$mnt/"
  mkdir -p "$mnt/usr/local/rustup/toolchains" "$mnt/usr/local/cargo/bin"
  cp -a "$tc" "$mnt/usr/local/rustup/toolchains/"
  printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\nauto_self_update = "disable"\n' \
    "$rustc_version-$toolchain_triple" >"$mnt/usr/local/rustup/settings.toml"
  cp "$(command -v rustup)" "$mnt/usr/local/cargo/bin/rustup"
  for proxy in cargo cargo-clippy cargo-fmt clippy-driver rustc rustdoc rustfmt rust-gdb rust-lldb; do
    ln -sf rustup "$mnt/usr/local/cargo/bin/$proxy"
  done
  chmod -R a+w "$mnt/usr/local/rustup" "$mnt/usr/local/cargo"
  if ((${#local_cas[@]})); then
    cp "${local_cas[@]}" "$mnt/usr/local/share/ca-certificates/"
    chroot "$mnt" update-ca-certificates >/dev/null
  fi
  buildah umount "$ctr" >/dev/null
  buildah config --arch amd64 --os linux --cmd bash \
    --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env RUST_VERSION="$rustc_version" \
    --label io.ipreclaim.stand-in="debootstrap bookworm + rustup toolchain $rustc_version (+ $std_target std built from Debian rust-src)" \
    "$ctr"
  buildah commit --quiet --rm "$ctr" "$build_base" >/dev/null
  echo "$build_base_key" >"$cache/build-base.done"
fi

# --- the runtime stage's base, one per arch ---------------------------------------------------
runtime_image() { echo "localhost/ipreclaim-stand-in/runtime:$1"; }
make_runtime_base() {
  local arch=$1 dir=$cache/runtime-$1
  have_image "$(runtime_image "$arch")" && [[ -f $dir.done ]] && return
  say "runtime base for $arch (libc6, libgcc-s1, ca-certificates, nonroot)"
  rm -rf "$dir" && mkdir -p "$dir/var/lib/dpkg/status.d" "$dir/etc/ssl/certs" "$dir/home/nonroot" "$dir/tmp"
  local pkg deb
  for pkg in libc6 libgcc-s1; do
    deb=$(apt_download "$pkg:$arch" "$cache/debs/$arch")
    dpkg-deb -x "$deb" "$dir"
    dpkg-deb -f "$deb" Package Version Architecture Source Maintainer Description >"$dir/var/lib/dpkg/status.d/$pkg"
  done
  cp "$rootfs/etc/ssl/certs/ca-certificates.crt" "$dir/etc/ssl/certs/"
  dpkg-query --admindir="$rootfs/var/lib/dpkg" -s ca-certificates |
    grep -E '^(Package|Version|Architecture|Maintainer|Description):' >"$dir/var/lib/dpkg/status.d/ca-certificates"
  mkdir -p "$dir/usr/share/doc/ca-certificates"
  cp "$rootfs/usr/share/doc/ca-certificates/copyright" "$dir/usr/share/doc/ca-certificates/"
  cp "$rootfs/etc/os-release" "$dir/etc/os-release"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$dir/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$dir/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$dir/etc/nsswitch.conf"
  chown 65532:65532 "$dir/home/nonroot"
  chmod 1777 "$dir/tmp"
  local ctr
  ctr=$(buildah from --quiet scratch)
  buildah copy --quiet "$ctr" "$dir" / >/dev/null
  buildah config --arch "$arch" --os linux --user 65532:65532 --workingdir /home/nonroot \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --label io.ipreclaim.stand-in="Debian bookworm libc6 + libgcc-s1 ($arch), ca-certificates, nonroot" "$ctr"
  buildah commit --quiet --rm "$ctr" "$(runtime_image "$arch")" >/dev/null
  touch "$dir.done"
}

make_runtime_base amd64
make_runtime_base arm64

# --- the Dockerfile, per arch ------------------------------------------------------------------
revision=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
created=$(git log -1 --format=%cI 2>/dev/null || date -u +%Y-%m-%dT%H:%M:%SZ)
say "bases ready in $(minutes "$start")"
# One build at a time (the runtime base's name points at the stand-in of the arch being built).
# The lock is the machine's, not the cache's: buildah's store is one per machine, and the removal
# of earlier builds' layers below must not take those of a build running from another cache.
lock=/run/lock/ipreclaim-image.lock
[[ -d /run/lock ]] || lock=$cache/build.lock
exec 9>"$lock"
flock 9
for arch in $arches; do
  buildah tag "$(runtime_image "$arch")" "$runtime_base"
  # buildah 1.28 looks a FROM without --platform up for the BUILDPLATFORM given below (amd64)
  # and finds no arm64 image by name (nor the arm64 instance of a manifest list); by image ID
  # it takes the stand-in as it is. The base.name label is set back to the name below.
  runtime_id=$(buildah inspect --type image --format '{{.FromImageID}}' "$(runtime_image "$arch")")
  tag=$image-$arch
  log=$cache/build-$arch.log
  t=$(date +%s)
  say "buildah bud --platform linux/$arch -t $tag (log: $log)"
  # BUILDPLATFORM given: buildah 1.28 sets it to --platform (the target) and would look for an
  # arm64 build stage; Docker and later buildah set the build machine's, as given here.
  if ! buildah bud --isolation chroot --layers --pull=never --platform "linux/$arch" \
    --build-arg BUILDPLATFORM="linux/$(dpkg --print-architecture)" --build-arg RUNTIME_BASE="$runtime_id" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" --build-arg CREATED="$created" \
    -t "$tag" -f Dockerfile . >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "scripts/image.sh: the $arch build failed (log: $log)" >&2
    exit 1
  fi
  tail -n 5 "$log" >&2
  # buildah 1.28's layer cache keys a LABEL step by its text, not by the build arguments in it:
  # a cached build keeps the revision and created labels of the build that made the layer.
  # Set them to this build's, as the LABEL step would have (metadata only).
  label() { buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"org.opencontainers.image.$1\"}}" "$tag"; }
  if [[ $(label revision) != "$revision" || $(label created) != "$created" || $(label base.name) != "$runtime_base" ]]; then
    ctr=$(buildah from --quiet --pull=never "$tag")
    buildah config --label "org.opencontainers.image.revision=$revision" \
      --label "org.opencontainers.image.created=$created" \
      --label "org.opencontainers.image.base.name=$runtime_base" "$ctr"
    buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
  fi
  say "$arch built in $(minutes "$t")"
  [[ $arch == amd64 ]] && buildah tag "$tag" "$image"
  rm -f "$out/ipreclaim-$arch.tar"
  buildah push --quiet "$tag" "docker-archive:$out/ipreclaim-$arch.tar:$tag" >/dev/null
  "$root/scripts/image-check.sh" "$tag" "$arch" "$version" "$revision"
done

# --- earlier builds' layers --------------------------------------------------------------------
# buildah --layers keeps an image per step, and the dependency step's holds a whole release build
# of the dependencies (GBs): a machine that keeps its store (a CI runner, a developer's) would
# grow by one on every change of Cargo.lock or the profile. Kept: what the last build of each
# arch used or made (the steps its log names) and every tagged image; removed: other untagged
# images built on the stand-in bases (their label), newest first so that a child goes before
# its parent.
kept=$(sed -nE 's/^--> (Using cache )?([0-9a-f]{11})[0-9a-f]*$/\2/p' "$cache"/build-*.log | sort -u)
if [[ -z $kept ]]; then
  # A log this script cannot read (another buildah's format) names nothing: then nothing goes.
  say "no layer named in the build logs: earlier builds' layers kept"
else
  removed=0
  while IFS='|' read -r _ id name; do
    [[ $name == "<none>" ]] || continue
    id=${id#sha256:}
    grep -qx "${id:0:11}" <<<"$kept" && continue
    [[ -n $(buildah inspect --type image --format '{{index .OCIv1.Config.Labels "io.ipreclaim.stand-in"}}' "$id" 2>/dev/null) ]] ||
      continue
    buildah rmi "$id" >/dev/null 2>&1 && removed=$((removed + 1))
  done < <(buildah images --all --noheading --no-trunc --format '{{.CreatedAtRaw}}|{{.ID}}|{{.Name}}' | sort -r)
  ((removed == 0)) || say "removed $removed layers of earlier builds"
fi
say "done in $(minutes "$start")"
