#!/usr/bin/env bash
# The README's first command: configure, build and run the demo.
#   scripts/demo.sh [demo arguments...]     e.g. --contexts 8192,262144
# Builds only the demo target (fast); with a GPU it builds for that GPU alone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build/demo"
arch="80;89;90a"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then arch=native; fi
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DHISPARSE_BUILD_TESTS=OFF -DHISPARSE_BUILD_BENCHMARKS=OFF -DHISPARSE_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$build" --target hisparse_demo -j "$(nproc)"
exec "$build/examples/hisparse_demo" "$@"
