# Session call 1 (lean): TopK tests, A/B bench, memcheck within a deadline.
S=build/sess
T0=$(date +%s)
left() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
tar xzf $S/bins.tgz -C $S
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
date -u > $OUT/when.txt
timeout 50 $S/test_gpu_attention "TopK*" > $OUT/test_topk.txt 2>&1; echo "rc $? $(date -u +%T)" >> $OUT/test_topk.txt
F='--batch=8 --context=262144 --benchmark_filter=BM_decode_(step|stream)/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
b() { timeout 80 $S/$1 $F --benchmark_out=$OUT/$2.json > $OUT/$2.txt 2>&1; echo "rc $? $(date -u +%T)" >> $OUT/$2.txt; }
b bench_attention_base base_1
b bench_attention new_1
left 200 && { timeout 60 compute-sanitizer --tool memcheck $S/test_gpu_attention "TopK*" > $OUT/memcheck.txt 2>&1; echo "rc $? $(date -u +%T)" >> $OUT/memcheck.txt; }
date -u >> $OUT/when.txt
