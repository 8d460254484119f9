#!/bin/bash
# untracked: the key-bounds cache test with planted signed zeros
OUT="$1"
mkdir -p /tmp/g && cd /tmp/g && xz -dc "$OLDPWD/build/gpu1.tar.xz" | tar x
export LD_LIBRARY_PATH=$(dirname $(find / -name 'libcudart.so.13' 2>/dev/null | head -1)):$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
timeout 60 ./test_gpu_kv "*key bounds*" > $OUT/test_gpu_kv.log 2>&1; echo "kv rc=$? $(tail -2 $OUT/test_gpu_kv.log | tr '\n' ' ')"
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 ./test_gpu_kv "*key bounds*" > $OUT/san_memcheck_kv.log 2>&1; echo "kv memcheck rc=$? $(tail -2 $OUT/san_memcheck_kv.log | tr '\n' ' ')"
