# Call W: activation top-k v3 (v1 + the row's first 32 KB sent to L2): its
# gating tests, racecheck and memcheck, beside the decode suites of 645fafb
# (test_gpu_attention, select, fp8_kv; every case its own process); then
# bench_gating for HEAD, v3, v1. $OUT/w.tgz is rewritten after each phase.
R=$(pwd); S=$R/build/sess; T0=$(date +%s)
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
pack() { tar czf $OUT/w.tgz -C $W .; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin; mkdir -p $B && tar xJf $S/bw.tar.xz -C $B
JOBS=13 TIMEOUT=150 scripts/gpu-tests-parallel.sh $W/tests $B/test_gpu_attention $B/test_gpu_select $B/test_gpu_fp8_kv > $W/tests.txt 2>&1 &
timeout 60 $B/test_gpu_gating_v3 > $W/test_v3.txt 2>&1; echo "rc $? $(el)" >> $W/test_v3.txt; echo "== test v3: $(tail -3 $W/test_v3.txt | tr '\n' ' ')"
timeout 60 compute-sanitizer --tool racecheck $B/test_gpu_gating_v3 "*activation*" > $W/racecheck.txt 2>&1; echo "== racecheck $(el)"; tail -n 2 $W/racecheck.txt
timeout 60 compute-sanitizer --tool memcheck $B/test_gpu_gating_v3 "*activation*" > $W/memcheck.txt 2>&1; echo "== memcheck $(el)"; tail -n 2 $W/memcheck.txt
pack; wait; echo "== decode suites $(el)"; tail -n 12 $W/tests.txt; pack
G='--benchmark_filter=BM_activation_topk --benchmark_out_format=json'
for r in 1 2; do for v in base v3 v1; do
  timeout 30 $B/bench_gating_$v $G --benchmark_out=$W/gating_${v}_$r.json > $W/gating_${v}_$r.txt 2>&1
  echo "== $v $r $(el): $(grep -o 'k_pct:[0-9]*/manual_time\|median_us=[0-9.]*' $W/gating_${v}_$r.txt | paste -sd' ' | sed 's|/manual_time||g')"
  pack
done; done
date -u >> $W/when.txt; pack
