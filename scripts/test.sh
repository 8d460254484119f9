#!/usr/bin/env bash
# The README's second command: build everything (tests, benchmarks, examples)
# for every supported architecture, run every non-GPU test, and build the
# examples/consumer project against a temporary install of the package.
# Installs Catch2 (Debian's `catch2`) and Google Benchmark if they are missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)

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
ctest --preset cpu -j "$jobs"

# The package as users consume it: install to a scratch prefix, then build a
# separate project against it with find_package(hisparse).
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/cpu --prefix "$prefix" >/dev/null
cmake -S examples/consumer -B build/consumer -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/consumer -j "$jobs"
./build/consumer/consumer
./build/consumer/consumer_decode  # a GPU decode step; says "skipped" without a device
echo "scripts/test.sh: all CPU tests passed; consumers built against the installed package"
