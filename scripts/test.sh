#!/usr/bin/env bash
# The whole test suite: setup (packages, Go-built control plane and node), formatting, lints,
# ipreclaim's image from the Dockerfile, tests (including the end-to-end scenarios on a real
# node, which run that image: needs root; the root tiers run in a lane of their own beside the
# others). Prints the minutes each part took.
#   --kind   then the kind suite too (e2e/kind/run.sh; CI: .ci/run): what it builds of its own
#            (kind, the node image) is built in the background while the tests run (they
#            mostly wait on apiservers), its cluster and scenarios run after them. It runs
#            even when the tests failed; either failing fails the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
kind=false
if [[ ${1:-} == --kind ]]; then kind=true; shift; fi
if [[ $# -ne 0 ]]; then echo "usage: $0 [--kind]" >&2; exit 2; fi
parts=()
t=$(date +%s)
# Each part's minutes, and the disk left after it: a run that fills the disk says where.
free_gib() { df -BG --output=avail "$root" | tail -n 1 | tr -dc 0-9; }
took() {
  parts+=("$1 $(( ($(date +%s) - t + 30) / 60 )) min")
  echo "test.sh: ${parts[-1]} (disk free: $(free_gib) GiB)" >&2
  t=$(date +%s)
}
free=$(free_gib || true)
if (( ${free:-0} < 40 )); then
  echo "test.sh: warning: ${free:-?} GiB free on $root; a whole run from a fresh machine takes about 32 (docs/development.md)" >&2
fi
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
root_log=$(mktemp)
kind_log=$(mktemp)
prepare_pid=""
root_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  # Nothing in the background outlives the run (their own traps clean up after them): the
  # root lane is a process group of its own (its test binary, not only cargo, must stop).
  if [[ -n $root_pid ]] && kill -0 "$root_pid" 2>/dev/null; then
    kill -- -"$root_pid" 2>/dev/null || true
    wait "$root_pid" 2>/dev/null || true
  fi
  if [[ -n $prepare_pid ]] && kill -0 "$prepare_pid" 2>/dev/null; then
    kill "$prepare_pid" 2>/dev/null || true
    wait "$prepare_pid" 2>/dev/null || true
  fi
  rm -f "$log" "$root_log" "$kind_log"
}
trap cleanup EXIT
status=0
# Every tier: without root in seconds and minutes, and (the feature) the root ones: the real
# node's e2e scenarios, the node agent and the CRI source on a private containerd. Compiled
# first, so that the kind suite's preparation takes the CPU only while the tests run.
# The tests run in two lanes side by side. The root tiers (one real node per machine) run one
# binary after the other in their own lane, beside the rest: they mostly wait on their node,
# and the e2e binary alone takes about 15 minutes. Every test target is in one lane
# (tests/project.rs checks the root list against the binaries the feature gates, and that
# these globs find every test target cargo knows).
root_tests=(e2e node_agent node_cri containerd)
other_tests=()
shopt -s nullglob
for f in tests/*.rs tests/*/main.rs crates/*/tests/*.rs crates/*/tests/*/main.rs; do
  name=${f%/main.rs}
  name=${name%.rs}
  name=${name##*/}
  [[ " ${root_tests[*]} " == *" $name "* ]] || other_tests+=(--test "$name")
done
shopt -u nullglob
cargo_test=(cargo test --workspace --features ipreclaim/root-tests --locked --no-fail-fast)
root_lane=("${cargo_test[@]}" "${root_tests[@]/#/--test=}")
other_lane=("${cargo_test[@]}" --lib --bins "${other_tests[@]}")
# Everything (examples too), then each lane's selection: a lane never compiles while the
# other runs tests (nothing is left to build after the first).
{ cargo test --workspace --features ipreclaim/root-tests --locked --no-run &&
  "${root_lane[@]}" --no-run && "${other_lane[@]}" --no-run; } 2>&1 | tee "$log" || status=$?
took "tests built"
if $kind; then
  echo "test.sh: the kind suite's preparation in the background (log: $kind_log)" >&2
  "$root/e2e/kind/run.sh" --prepare >"$kind_log" 2>&1 &
  prepare_pid=$!
fi
if ((status == 0)); then
  echo "test.sh: the root tiers (${root_tests[*]}) in a lane of their own (log: $root_log)" >&2
  set -m # a process group of its own, for the cleanup to stop
  "${root_lane[@]}" >"$root_log" 2>&1 &
  root_pid=$!
  set +m
  lane_started=$(date +%s)
  "${other_lane[@]}" 2>&1 | tee "$log" || status=$?
  "${cargo_test[@]}" --doc 2>&1 | tee -a "$log" || status=$?
  echo "test.sh: the other tiers took $(( ($(date +%s) - lane_started + 30) / 60 )) min; waiting for the root lane" >&2
  rooted=0
  wait "$root_pid" || rooted=$?
  root_pid=""
  echo "test.sh: the root lane (exit $rooted):" >&2
  cat "$root_log"
  cat "$root_log" >>"$log"
  if ((rooted != 0 && status == 0)); then status=$rooted; fi
fi
took tests
kind_status=0
if $kind; then
  prepared=0
  wait "$prepare_pid" || prepared=$?
  prepare_pid=""
  echo "test.sh: the kind suite's preparation (exit $prepared):" >&2
  cat "$kind_log" >&2
  took "kind preparation (after the tests)"
  if ((prepared == 0)); then
    "$root/e2e/kind/run.sh" || kind_status=$?
  else
    kind_status=$prepared
  fi
  took "kind suite"
fi
echo "test.sh: ${parts[*]}"
# One closing line over every test binary and doc-test run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "cargo test: %d passed, %d failed\n", p, f }' "$log"
if $kind; then echo "e2e/kind/run.sh: exit $kind_status"; fi
if ((status != 0)); then exit "$status"; fi
exit "$kind_status"
