#!/usr/bin/env bash
# The chaos suite (opt-in, bounded, seeded): two controller replicas, each behind an API fault
# proxy, against a private control plane; the real whereabouts CNI allocates; one fault per
# trial (see benches/chaos.rs); invariants checked every 100 ms; prints each trial's seed and a
# table, exits 1 on any violation.
# Args: [--seed S] [--trials N] [--kinds ZoneOutage,WriteStorm,...] (default: one trial per
# fault kind). CHAOS_IPRECLAIM=<binary> runs another build (e.g. an older commit's),
# CHAOS_CONTROLLER_ARGS="--flag=value" overrides controller flags and CHAOS_RELEASE_ARGS adds
# flags to the ManualRaces trials' `ipreclaim release` (e.g. --force), to see what the suite finds.
set -euo pipefail
cd "$(dirname "$0")/.."
IPRECLAIM_BIN_DIR=$(./scripts/setup.sh | tail -n 1)
export IPRECLAIM_BIN_DIR
exec cargo bench --locked --bench chaos -- "$@"
