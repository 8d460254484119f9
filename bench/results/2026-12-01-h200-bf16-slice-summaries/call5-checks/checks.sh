#!/bin/bash
# untracked: final checks of the bf16 slice-summary policy on the GPU host
OUT="$1"
mkdir -p /tmp/g && cd /tmp/g && xz -dc "$OLDPWD/build/gpu6.tar.xz" | tar x
export LD_LIBRARY_PATH=$(dirname $(find / -name 'libcudart.so.13' 2>/dev/null | head -1)):$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
for p in standard standard_bf16_summaries; do
  echo "[$(date +%T)] demo $p"; timeout 150 ./hisparse_demo --contexts 32768,131072,262144 --preset $p 2>&1 | tail -6
done
echo "[$(date +%T)] tests"
for t in test_gpu_select test_gpu_attention; do
  timeout 300 ./$t > $OUT/$t.log 2>&1; echo "$t rc=$? $(tail -2 $OUT/$t.log | tr '\n' ' ')"
done
echo "[$(date +%T)] sanitizers"
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 ./test_gpu_select "*bf16*" > $OUT/san_${tool}_select.log 2>&1; echo "select $tool rc=$? $(tail -3 $OUT/san_${tool}_select.log | tr '\n' ' ')"
done
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 ./test_gpu_attention "sparse decode step on bf16*" > $OUT/san_memcheck_attention.log 2>&1; echo "attention memcheck rc=$? $(tail -3 $OUT/san_memcheck_attention.log | tr '\n' ' ')"
timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 ./test_gpu_attention "sparse decode step on bf16*" > $OUT/san_racecheck_attention.log 2>&1; echo "attention racecheck rc=$? $(tail -3 $OUT/san_racecheck_attention.log | tr '\n' ' ')"
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 ./test_gpu_kv > $OUT/san_memcheck_kv.log 2>&1; echo "kv memcheck rc=$? $(tail -3 $OUT/san_memcheck_kv.log | tr '\n' ' ')"
echo "[$(date +%T)] end"
