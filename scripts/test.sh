#!/usr/bin/env bash
# The README's second command: build everything (tests, benchmarks, examples)
# for every supported architecture, run every non-GPU test, and build the
# examples/consumer project against a temporary install of the package.
# Installs Catch2 (Debian's `catch2`) and Google Benchmark if they are missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
elapsed() { echo "scripts/test.sh: $1 (${SECONDS}s)"; }  # where CI's time goes

need=()
[ -f /usr/include/catch2/catch.hpp ] || need+=(catch2)
[ -f /usr/include/benchmark/benchmark.h ] || need+=(libbenchmark-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${need[@]}" >/dev/null
fi

cd "$root"
cmake --preset cpu
cmake --build --preset cpu -j "$jobs"
elapsed "built every test, benchmark and example"
ctest --preset cpu -j "$jobs"
elapsed "CPU tests passed"

# The package as users consume it: install to a scratch prefix, then build a
# separate project against it with find_package(hisparse).
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/cpu --prefix "$prefix" >/dev/null
# One architecture: what this proves is the package's use, and the build
# above compiled the same kernels for every architecture.
cmake -S examples/consumer -B build/consumer -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${HISPARSE_CONSUMER_ARCH:-80}" >/dev/null
cmake --build build/consumer -j "$jobs"
./build/consumer/consumer
./build/consumer/consumer_decode  # a GPU decode step; says "skipped" without a device
elapsed "consumers built and run"

# The PyTorch package (python/): its bindings built in place for one
# architecture, linked with the kernel instances compiled above for all of
# them, and its CPU tests run: import, argument checks, the CPU and fake
# kernels, opcheck, torch.compile. Needs an interpreter with torch:
# HISPARSE_PYTHON, else python3; without one the step says it is skipped.
py=${HISPARSE_PYTHON:-python3}
# HISPARSE_PYTHON_PENDING: the pid of a still-running install of that
# interpreter's packages (.ci/run starts one beside the build).
if [ -n "${HISPARSE_PYTHON_PENDING:-}" ]; then
  while kill -0 "$HISPARSE_PYTHON_PENDING" 2>/dev/null; do sleep 2; done
  elapsed "interpreter's packages installed"
fi
if "$py" -c "import torch, pytest" 2>/dev/null; then
  # The kernel instances come from the build above (HISPARSE_INSTANCES):
  # only the bindings compile here.
  HISPARSE_INSTANCES="$root/build/cpu" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0} MAX_JOBS=$jobs \
    "$py" setup.py -q build_ext --inplace >/dev/null
  elapsed "PyTorch extension built"
  PYTHONPATH=python "$py" -m pytest -q -p no:cacheprovider python/tests
  python_note="python tests passed (GPU ones skipped without a device)"
else
  python_note="python tests SKIPPED: no interpreter with torch and pytest (set HISPARSE_PYTHON)"
  echo "scripts/test.sh: $python_note"
  if [ -n "${HISPARSE_PYTHON_LOG:-}" ]; then tail -5 "$HISPARSE_PYTHON_LOG"; fi
fi
echo "scripts/test.sh: all CPU tests passed; consumers built against the installed package; $python_note"
