#!/usr/bin/env bash
# Runs every test case of the given Catch2 binaries as its own process, JOBS
# at a time, for a GPU host reached by short calls: the GPU suites are bound
# by their fp64 references on one core each, and one after another
# (test_gpu_attention alone > 5 minutes on an H100 host) they outlast a call.
#   scripts/gpu-tests-parallel.sh OUT_DIR BINARY...
# Environment: JOBS (default: nproc), TIMEOUT seconds a case (default 300).
# Each case's output goes to OUT_DIR/<binary>.<n>.txt; prints a line per case
# that failed or was skipped, then a summary. Exits 1 if any case failed.
set -uo pipefail
out=${1:?usage: scripts/gpu-tests-parallel.sh OUT_DIR BINARY...}
shift
[ $# -gt 0 ] || { echo "no test binaries given" >&2; exit 2; }
mkdir -p "$out"
cases=$out/cases.tsv
: > "$cases"
for bin in "$@"; do
  [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
  "$bin" --list-test-names-only | sed '/^$/d' | awk -v b="$bin" '{ printf "%s\t%d\t%s\n", b, NR, $0 }' >> "$cases"
done

run_case() {
  local bin name n log spec
  IFS=$'\t' read -r bin n name <<< "$1"
  log=$OUT_DIR/$(basename "$bin").$n.txt
  spec=$(printf '%s' "$name" | sed 's/[][,\\]/\\&/g')  # Catch2's test-spec specials
  timeout "$CASE_TIMEOUT" "$bin" "$spec" > "$log" 2>&1
  local rc=$?
  if grep -q HISPARSE_TEST_SKIPPED "$log"; then echo "skipped $(basename "$bin"): $name"
  elif [ $rc -ne 0 ] || ! grep -q 'All tests passed' "$log"; then echo "FAILED (rc $rc) $(basename "$bin"): $name -> $log"
  else echo "passed"; fi
}
export -f run_case
export OUT_DIR=$out CASE_TIMEOUT=${TIMEOUT:-300}
results=$(tr '\n' '\0' < "$cases" | xargs -0 -P "${JOBS:-$(nproc)}" -I{} bash -c 'run_case "$1"' _ {})
printf '%s\n' "$results" | grep -v '^passed$'
total=$(wc -l < "$cases")
passed=$(printf '%s\n' "$results" | grep -c '^passed$')
skipped=$(printf '%s\n' "$results" | grep -c '^skipped')
failed=$(printf '%s\n' "$results" | grep -c '^FAILED')
echo "$total cases: $passed passed, $skipped skipped, $failed failed"
[ "$failed" -eq 0 ] && [ $((passed + skipped)) -eq "$total" ]
