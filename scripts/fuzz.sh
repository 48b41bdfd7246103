#!/usr/bin/env bash
# Long fuzz run of every parser of untrusted input (NAD config, network-status, networks
# annotation, pool keys and ranges, fence annotations, objects read one by one): arbitrary
# bytes and arbitrary JSON, PROPTEST_CASES per target (default 1,000,000).
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${PROPTEST_CASES:-1000000}"
start=$(date +%s)
PROPTEST_CASES="$cases" cargo test --release --locked --test fuzz -- --test-threads=2
targets=$(grep -c '^    fn ' tests/fuzz.rs)
echo "fuzz: ${targets} targets x ${cases} cases = $((targets * cases)) cases, no failure, $(($(date +%s) - start)) s"
