# One call on the device: the late TopK rule (issue 31.1). P=1: TopK tests,
# A/B stream bench (new, base), sanitizers on the TopK tests; P=2: a second
# A/B and the rest of the decode tests. Each optional step only where it
# fits in D seconds.
R=$(pwd); S=$R/build/sess; D=${D:-560}; P=${P:-1}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
date -u > $OUT/when.txt
cat $OUT/gpu.txt
B=$S/bin; mkdir -p $B && for f in $S/bin*.tgz; do tar xzf $f -C $B; done
t() { timeout $2 $B/$1 ${3:+"$3"} > $OUT/$1$4.txt 2>&1; echo "rc $? $(el)" >> $OUT/$1$4.txt; echo "== $1 $3"; tail -3 $OUT/$1$4.txt; }
F='--batch=8 --context=262144 --benchmark_filter=BM_decode_(step|stream)/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
b() { timeout $3 $1 $F --benchmark_out=$OUT/$2.json > $OUT/$2.txt 2>&1; echo "rc $? $(el)" >> $OUT/$2.txt; echo "== $2"; grep -E "^BM_|rc " $OUT/$2.txt | cut -c1-900; }
s() { timeout $2 compute-sanitizer --tool $1 $B/test_gpu_attention "${SAN:-TopK*}" > $OUT/$1.txt 2>&1; echo "rc $? $(el)" >> $OUT/$1.txt; echo "== $1"; tail -4 $OUT/$1.txt; }
if [ "$P" = 1 ]; then
  t test_gpu_attention 100 "TopK*" _topk
  b $B/bench_attention new_1 170
  b $B/bench_attention_base base_1 110
  fits 120 && s memcheck 120
  fits 100 && s racecheck 100
else
  b $B/bench_attention new_2 170
  b $B/bench_attention_base base_2 110
  fits 200 && t test_gpu_attention 200 "" _all
  fits 60 && t test_gpu_select 60 "" ""
  fits 60 && t test_gpu_fp8_kv 60 "" ""
  fits 30 && t test_gpu_model_decode 30 "" ""
fi
date -u >> $OUT/when.txt
