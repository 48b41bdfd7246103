#!/usr/bin/env bash
# The whole test suite: setup (packages, Go-built control plane), formatting, lints, tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=$("$root/scripts/setup.sh" | tail -n 1)
export IPRECLAIM_BIN_DIR="$bin"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked 2>&1 | tee "$log" || status=$?
# One closing line over every test binary and doc-test run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "cargo test: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
