#!/bin/bash
# untracked: the P split that keeps infinite values exact, and the review mends
OUT="$1"
mkdir -p /tmp/g && cd /tmp/g && xz -dc "$OLDPWD/build/gpu1.tar.xz" | tar x
export LD_LIBRARY_PATH=$(dirname $(find / -name 'libcudart.so.13' 2>/dev/null | head -1)):$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
echo "[$(date +%T)] bench_attention"
timeout 100 ./bench_attention --benchmark_filter='BM_decode_step(_key_bounds)?/B:(1|8|32)/T:262144' --benchmark_out=$OUT/step.json --benchmark_out_format=json 2>&1 | grep -E "^BM_" | cut -c1-110
echo "[$(date +%T)] tests"
timeout 240 ./test_gpu_attention > $OUT/test_gpu_attention.log 2>&1; echo "attention rc=$? $(tail -2 $OUT/test_gpu_attention.log | tr '\n' ' ')"
timeout 60 ./test_gpu_kv "*key bounds*" > $OUT/test_gpu_kv.log 2>&1; echo "kv rc=$? $(tail -2 $OUT/test_gpu_kv.log | tr '\n' ' ')"
timeout 60 ./test_gpu_select "[bounds]" > $OUT/test_gpu_select.log 2>&1; echo "select rc=$? $(tail -2 $OUT/test_gpu_select.log | tr '\n' ' ')"
echo "[$(date +%T)] sanitizer"
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 ./test_gpu_attention "*NaN and infinite keys*" > $OUT/san_memcheck_attention.log 2>&1; echo "attention memcheck rc=$? $(tail -2 $OUT/san_memcheck_attention.log | tr '\n' ' ')"
echo "[$(date +%T)] end"
