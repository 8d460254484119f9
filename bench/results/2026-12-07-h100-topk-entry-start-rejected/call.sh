# One call: link, TopK tests, A/B stream bench, sanitizers on TopK, then the
# rest of the decode tests, each optional step only where it fits in D seconds.
R=$(pwd); S=$R/build/sess; D=${D:-500}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
date -u > $OUT/when.txt
mkdir -p build/h200 && (cd build/h200 && tar xzf $S/objs.tgz && bash $S/link.sh) > $OUT/link.txt 2>&1
echo "linked rc $? $(el)" | tee -a $OUT/when.txt
B=$R/build/h200
t() { timeout $2 $B/test/$1 ${3:+"$3"} > $OUT/$1$4.txt 2>&1; echo "rc $? $(el)" >> $OUT/$1$4.txt; echo "== $1 $3"; tail -3 $OUT/$1$4.txt; }
F='--batch=8 --context=262144 --benchmark_filter=BM_decode_(step|stream)/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
b() { timeout 110 $1 $F --benchmark_out=$OUT/$2.json > $OUT/$2.txt 2>&1; echo "rc $? $(el)" >> $OUT/$2.txt; echo "== $2"; grep -E "^BM_|rc " $OUT/$2.txt | cut -c1-600; }
s() { timeout $2 compute-sanitizer --tool $1 $B/test/test_gpu_attention "TopK*" > $OUT/$1.txt 2>&1; echo "rc $? $(el)" >> $OUT/$1.txt; echo "== $1"; tail -4 $OUT/$1.txt; }
t test_gpu_attention 90 "TopK*" _topk
b $B/bench/bench_attention new_1
b $S/bench_attention_base base_1
fits 80 && s memcheck 80
fits 70 && s racecheck 70
fits 150 && t test_gpu_attention 150 "" _all
fits 60 && t test_gpu_select 60 "" ""
fits 30 && t test_gpu_fp8_kv 30 "" ""
fits 30 && t test_gpu_model_decode 30 "" ""
date -u >> $OUT/when.txt
