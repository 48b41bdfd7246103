#!/usr/bin/env bash
# The whole test suite: setup (packages, Go-built control plane and node), formatting, lints,
# ipreclaim's image from the Dockerfile, tests (including the end-to-end scenarios on a real
# node, which run that image: needs root). Prints the minutes each part took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
parts=()
t=$(date +%s)
took() { parts+=("$1 $(( ($(date +%s) - t + 30) / 60 )) min"); echo "test.sh: ${parts[-1]}" >&2; t=$(date +%s); }
bin=$("$root/scripts/setup.sh" | tail -n 1)
export IPRECLAIM_BIN_DIR="$bin"
took setup
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --features ipreclaim/root-tests --locked -- -D warnings
took lints
# The image the real node's e2e tests run: the Dockerfile built with buildah on stand-in bases
# made here, then checked as a scanner would (scripts/image-check.sh). The tests call the same
# script (cached layers); built here so that its output is in the log and not inside a test.
IMAGE=localhost/ipreclaim/ipreclaim:e2e "$root/scripts/image.sh" amd64
took image
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# Every tier: without root in seconds and minutes, and (the feature) the root ones: the real
# node's e2e scenarios, the node agent and the CRI source on a private containerd.
cargo test --workspace --features ipreclaim/root-tests --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
took tests
echo "test.sh: ${parts[*]}"
# One closing line over every test binary and doc-test run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "cargo test: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
