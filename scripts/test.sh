#!/usr/bin/env bash
# The whole test suite: setup (packages, Go-built control plane and node), formatting, lints,
# the image binary, tests (including the end-to-end scenarios on a real node: needs root).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=$("$root/scripts/setup.sh" | tail -n 1)
export IPRECLAIM_BIN_DIR="$bin"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The release binary the real node's ipreclaim image holds (the e2e tests build it too when
# missing; built here so that its output is in the log and not inside a test).
cargo build --release --locked --bin ipreclaim --target-dir target/image
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
# One closing line over every test binary and doc-test run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "cargo test: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
