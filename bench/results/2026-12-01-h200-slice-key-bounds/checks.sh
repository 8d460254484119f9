#!/bin/bash
# untracked: GPU checks of the key_bounds policy. $1 = OUT, $2 = a | b
OUT="$1"; MODE="$2"
mkdir -p /tmp/g && cd /tmp/g && xz -dc "$OLDPWD/build/gpu1.tar.xz" | tar x
export LD_LIBRARY_PATH=$(dirname $(find / -name 'libcudart.so.13' 2>/dev/null | head -1)):$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
if [ "$MODE" = a ]; then
  for p in standard standard_key_bounds; do
    echo "[$(date +%T)] demo $p"; timeout 150 ./hisparse_demo --contexts 32768,131072,262144 --preset $p 2>&1 | tail -5
  done
  echo "[$(date +%T)] bench_select"
  timeout 120 ./bench_select --benchmark_filter='BM_decode_selection(_key_bounds)?/B:(1|8|32)/T:262144' --benchmark_out=$OUT/select.json --benchmark_out_format=json 2>&1 | grep -E "^BM_" | cut -c1-150
  echo "[$(date +%T)] bench_attention"
  timeout 150 ./bench_attention --benchmark_filter='BM_decode_step(_key_bounds)?/B:(1|8|32)/T:262144' --benchmark_out=$OUT/step.json --benchmark_out_format=json 2>&1 | grep -E "^BM_" | cut -c1-150
  echo "[$(date +%T)] tests"
  timeout 200 ./test_gpu_select > $OUT/test_gpu_select.log 2>&1; echo "select rc=$? $(tail -2 $OUT/test_gpu_select.log | tr '\n' ' ')"
  timeout 60 ./test_gpu_kv "*key bounds*" > $OUT/test_gpu_kv.log 2>&1; echo "kv rc=$? $(tail -2 $OUT/test_gpu_kv.log | tr '\n' ' ')"
else
  echo "[$(date +%T)] demo"; timeout 100 ./hisparse_demo --contexts 262144 --preset standard_key_bounds 2>&1 | tail -3
  echo "[$(date +%T)] bench_select"
  timeout 100 ./bench_select --benchmark_filter='BM_decode_selection(_key_bounds)?/B:(1|8|32)/T:262144' --benchmark_out=$OUT/select.json --benchmark_out_format=json 2>&1 | grep -E "^BM_" | cut -c1-110
  echo "[$(date +%T)] bench_attention"
  timeout 120 ./bench_attention --benchmark_filter='BM_decode_step(_key_bounds)?/B:(1|8|32)/T:262144' --benchmark_out=$OUT/step.json --benchmark_out_format=json 2>&1 | grep -E "^BM_" | cut -c1-110
  echo "[$(date +%T)] tests"
  timeout 150 ./test_gpu_select "[bounds]" > $OUT/test_gpu_select.log 2>&1; echo "select rc=$? $(tail -2 $OUT/test_gpu_select.log | tr '\n' ' ')"
  timeout 150 ./test_gpu_attention "*slice*" > $OUT/test_gpu_attention.log 2>&1; echo "attention rc=$? $(tail -2 $OUT/test_gpu_attention.log | tr '\n' ' ')"
  timeout 60 ./test_gpu_attention "*adapter*" > $OUT/test_gpu_attention_adapter.log 2>&1; echo "attention adapter rc=$? $(tail -2 $OUT/test_gpu_attention_adapter.log | tr '\n' ' ')"
  echo "[$(date +%T)] sanitizers"
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 ./test_gpu_select "[bounds]" > $OUT/san_${tool}_select.log 2>&1; echo "select $tool rc=$? $(tail -3 $OUT/san_${tool}_select.log | tr '\n' ' ')"
  done
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 3 ./test_gpu_attention "[bounds]" > $OUT/san_memcheck_attention.log 2>&1; echo "attention memcheck rc=$? $(tail -3 $OUT/san_memcheck_attention.log | tr '\n' ' ')"
  timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 ./test_gpu_kv "*key bounds*" > $OUT/san_memcheck_kv.log 2>&1; echo "kv memcheck rc=$? $(tail -3 $OUT/san_memcheck_kv.log | tr '\n' ' ')"
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 ./test_gpu_kv "*key bounds*" > $OUT/san_racecheck_kv.log 2>&1; echo "kv racecheck rc=$? $(tail -3 $OUT/san_racecheck_kv.log | tr '\n' ' ')"
fi
echo "[$(date +%T)] end"
