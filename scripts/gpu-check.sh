#!/usr/bin/env bash
# The one command for a GPU host: build for sm_90a, run the GPU tests, run them
# again under compute-sanitizer (memcheck, racecheck), run the benchmarks with
# JSON output, and print a short summary last.
#   scripts/gpu-check.sh OUT_DIR
# Environment (all optional, for splitting the work over several short calls):
#   HISPARSE_TARGETS   targets to build (default: all; "none": no build, no ctest)
#   HISPARSE_BENCH     regex of benchmark programs to run (default: all; "none": none)
#   HISPARSE_SANITIZE  regex of test binaries to sanitize (default: all; "none": none)
#   HISPARSE_DEMO=1    also run the demo (its table goes to stdout)
#   HISPARSE_PYTHON=1  also pip-install the PyTorch package on this host, check
#                      that it links the shared libstdc++, run its tests from
#                      outside the tree (and under memcheck with
#                      HISPARSE_PYTHON_MEMCHECK=1, after torch_ops_bench.py)
#   HISPARSE_BUILD_COMMIT / HISPARSE_BUILD_DIRTY  the commit the benchmark JSON
#                      names, where the host's copy of the tree lacks its git
#                      history (cmake/commit_header.cmake)
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$root"
summary=()
# Only JSON, the sanitizer digest and this script's own output go to OUT_DIR
# (a lent GPU host returns few files); the rest stays in a scratch folder.
scratch=$(mktemp -d)
if [ "${HISPARSE_TARGETS:-}" != none ]; then
  echo "== $(date +%T) configure and build =="
  cmake --preset h200 -DHISPARSE_BUILD_TESTS=ON >/dev/null || exit 1
  if [ -n "${HISPARSE_TARGETS:-}" ]; then
    # shellcheck disable=SC2086
    cmake --build --preset h200 -j "$(nproc)" --target $HISPARSE_TARGETS || exit 1
  else
    cmake --build --preset h200 -j "$(nproc)" || exit 1
  fi
  echo "== $(date +%T) built; GPU tests =="
  ctest --preset h200 -j 4 --timeout 240 2>&1 | tee "$scratch/ctest-gpu.log"
  summary+=("ctest -L gpu: $(grep -E 'tests passed|tests failed' "$scratch/ctest-gpu.log" | tail -1)")
fi
echo "== $(date +%T) benchmarks =="

# HISPARSE_BENCH=regex limits the benchmark programs (default: all of them).
for exe in build/h200/bench/bench_*; do
  [ -x "$exe" ] || continue
  [[ "$(basename "$exe")" =~ ${HISPARSE_BENCH:-.} ]] || continue
  name=$(basename "$exe")
  "$exe" --benchmark_out="$out/$name.json" --benchmark_out_format=json \
    --benchmark_min_time=0.2 >"$scratch/$name.txt" 2>&1 || summary+=("$name: FAILED")
  summary+=("$name: $(grep -c '^BM_' "$scratch/$name.txt") results")
done

# The PyTorch decode step (dense SDPA and the same selection in PyTorch).
if [[ bench_attention =~ ${HISPARSE_BENCH:-.} ]] && [ -x build/h200/bench/bench_attention ]; then
  if python3 scripts/torch_decode.py "$out/torch_decode.json" >"$scratch/torch_decode.txt" 2>&1; then
    summary+=("torch_decode: done")
  else
    summary+=("torch_decode: FAILED")
  fi
  cat "$scratch/torch_decode.txt"
fi

if [ "${HISPARSE_DEMO:-0}" = 1 ] && [ -x build/h200/examples/hisparse_demo ]; then
  echo "== demo =="
  build/h200/examples/hisparse_demo --contexts "${HISPARSE_DEMO_CONTEXTS:-32768,262144}" || summary+=("demo: FAILED")
fi

# torch.topk on the same shapes as bench_topk, for the side-by-side table.
if [[ bench_topk =~ ${HISPARSE_BENCH:-.} ]] && [ -x build/h200/bench/bench_topk ]; then
  if python3 scripts/torch_topk.py "$out/torch_topk.json" >"$scratch/torch_topk.txt" 2>&1; then
    summary+=("torch_topk: done")
    cat "$scratch/torch_topk.txt"
  else
    summary+=("torch_topk: FAILED")
  fi
fi

# torch.topk on bench_gating's activation shapes.
if [[ bench_gating =~ ${HISPARSE_BENCH:-.} ]] && [ -x build/h200/bench/bench_gating ]; then
  if python3 scripts/torch_gating.py "$out/torch_gating.json" >"$scratch/torch_gating.txt" 2>&1; then
    summary+=("torch_gating: done")
    cat "$scratch/torch_gating.txt"
  else
    summary+=("torch_gating: FAILED")
  fi
fi

if [ "${HISPARSE_PYTHON:-0}" = 1 ]; then
  echo "== $(date +%T) the PyTorch package =="
  if TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=$(nproc) \
      python3 -m pip install --no-build-isolation --no-deps . >"$scratch/pip.txt" 2>&1; then
    so=$(cd /tmp && python3 -c "import hisparse; print(hisparse._library_path)")
    # An extension with its own C++ runtime crashes on the first exception an op throws (setup.py).
    if readelf -d "$so" | grep -q 'libstdc++' && ! nm -D --defined-only "$so" | grep -q ' __cxa_throw$'; then
      summary+=("pip install: built, shared libstdc++")
    else
      summary+=("pip install: built, but NOT linked to the shared libstdc++")
    fi
    if ! python3 -c "import pytest" 2>/dev/null; then
      summary+=("pytest python/tests: skipped, no pytest here (put a copy on PYTHONPATH)")
    else
      (cd /tmp && python3 -m pytest -q -p no:cacheprovider "$root/python/tests") >"$scratch/pytest.txt" 2>&1
      summary+=("pytest python/tests: $(grep -E 'passed|failed|Segmentation' "$scratch/pytest.txt" | tail -1)")
      cp "$scratch/pytest.txt" "$out/pytest.txt"
    fi
    if python3 scripts/torch_ops_bench.py "$out/torch_ops.json" >"$scratch/torch_ops.txt" 2>&1; then
      summary+=("torch_ops_bench: done")
      cat "$scratch/torch_ops.txt"
    else
      summary+=("torch_ops_bench: FAILED")
    fi
    if [ "${HISPARSE_PYTHON_MEMCHECK:-0}" = 1 ] && python3 -c "import pytest" 2>/dev/null; then
      (cd /tmp && timeout "${HISPARSE_PYTHON_MEMCHECK_TIMEOUT:-1200}" compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider "$root/python/tests/test_cache.py") >"$scratch/pytest-memcheck.txt" 2>&1
      summary+=("memcheck pytest test_cache.py: $(grep -E 'ERROR SUMMARY' "$scratch/pytest-memcheck.txt" | tail -1)")
    fi
  else
    summary+=("pip install: FAILED")
    tail -n 20 "$scratch/pip.txt"
  fi
fi

echo "== $(date +%T) sanitizers =="
# Sanitizers last: the slowest part, and the results above are already saved.
# compute-sanitizer over every test binary that has GPU tests, one process
# per test case, HISPARSE_SANITIZE_JOBS (4) at a time: a whole binary under
# racecheck outlasted any timeout, and a case that hangs costs only itself.
# A case's name is escaped for Catch's test spec (',', '[', ']', '\').
catch_escape() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/,/\\,/g' -e 's/\[/\\[/g' -e 's/\]/\\]/g'; }
for exe in build/h200/test/test_gpu_*; do
  [ -x "$exe" ] || continue
  [[ "$(basename "$exe")" =~ ${HISPARSE_SANITIZE:-.} ]] || continue
  for tool in memcheck racecheck; do
    logs=$(mktemp -d)
    # Tests tagged [expected_api_error] make a CUDA call fail on purpose: run
    # them without API-error reporting, everything else with it.
    expected=true
    if "$exe" --list-test-names-only "[expected_api_error]" 2>/dev/null | grep -q '[a-z]'; then
      timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 1 --report-api-errors no "$exe" \
        "[expected_api_error]" >"$logs/api" 2>&1 || expected=false
    fi
    # HISPARSE_SANITIZE_SPEC_<binary> narrows a binary's test cases (to keep
    # the CPU-reference-heavy ones out of a short call).
    spec_var="HISPARSE_SANITIZE_SPEC_$(basename "$exe")"
    spec="${!spec_var:-[gpu]~[expected_api_error]}"
    mapfile -t cases < <("$exe" --list-test-names-only "$spec" 2>/dev/null | grep '[[:alnum:]]')
    i=0
    for name in "${cases[@]}"; do
      ( timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 1 "$exe" "$(catch_escape "$name")" \
          >"$logs/case.$i" 2>&1 || echo "$name" >>"$logs/failed" ) &
      i=$((i + 1))
      while [ "$(jobs -rp | wc -l)" -ge "${HISPARSE_SANITIZE_JOBS:-4}" ]; do wait -n; done
    done
    wait
    if [ ${#cases[@]} -gt 0 ] && [ ! -s "$logs/failed" ] && $expected; then
      summary+=("$tool $(basename "$exe"): clean (${#cases[@]} cases)")
    else
      summary+=("$tool $(basename "$exe"): FAILED (see sanitize.log)")
    fi
    {
      echo "=== $tool $(basename "$exe"): ${#cases[@]} cases"
      [ -s "$logs/failed" ] && { echo "failed:"; cat "$logs/failed"; }
      for f in "$logs"/case.*; do [ -f "$f" ] && grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|test cases" "$f"; done | sort | uniq -c
      [ -f "$logs/api" ] && tail -n 5 "$logs/api"
    } >>"$out/sanitize.log"
    rm -rf "$logs"
  done
done

echo
echo "== benchmark rows =="
for f in "$scratch"/bench_*.txt; do grep -h '^BM_' "$f" | cut -c1-160; done
echo
echo "== gpu-check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${HISPARSE_BUILD_COMMIT:-${HISPARSE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}}) =="
printf '%s\n' "${summary[@]}"
