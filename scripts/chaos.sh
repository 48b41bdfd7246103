#!/usr/bin/env bash
# The chaos suite (opt-in, bounded, seeded): faults injected while a stand-in allocator and
# pod deletions run against two controller processes on a private control plane; prints each
# trial's seed and a table, exits 1 on any violation. Args: [--seed S] [--trials N] (default
# 5 trials, one per fault kind).
set -euo pipefail
cd "$(dirname "$0")/.."
IPRECLAIM_BIN_DIR=$(./scripts/setup.sh | tail -n 1)
export IPRECLAIM_BIN_DIR
exec cargo bench --locked --bench chaos -- "$@"
