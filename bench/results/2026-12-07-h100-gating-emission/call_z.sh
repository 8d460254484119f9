# Call Z: activation top-k, two variants (v1: unrolled staging of the
# emission, a positive candidate's word from its bits; v2: v1, the row's
# first 32 KB sent to L2 at the start, candidates past the buffer into a
# sink word) against HEAD, same call; the gating tests for both; sanitizers;
# torch.topk on the same shapes. One archive ($OUT/z.tgz).
R=$(pwd); S=$R/build/sess; T0=$(date +%s); D=${D:-400}
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
trap 'date -u >> $W/when.txt; tar czf $OUT/z.tgz -C $W .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin; mkdir -p $B && tar xJf $S/bz.tar.xz -C $B
for v in v1 v2; do timeout 150 $B/test_gpu_gating_$v --durations yes > $W/test_$v.txt 2>&1; echo "rc $? $(el)" >> $W/test_$v.txt; echo "== test $v: $(tail -3 $W/test_$v.txt | tr '\n' ' ')"; done
G='--benchmark_filter=BM_activation_topk --benchmark_out_format=json'
for r in 1 2; do for v in base v1 v2; do
  timeout 60 $B/bench_gating_$v $G --benchmark_out=$W/gating_${v}_$r.json > $W/gating_${v}_$r.txt 2>&1
  echo "== $v $r $(el): $(grep -o 'k_pct:[0-9]*/manual_time\|median_us=[0-9.]*' $W/gating_${v}_$r.txt | paste -sd' ' | sed 's|/manual_time||g')"
done; done
fits 60 && { timeout 90 python3 scripts/torch_gating.py $W/torch_gating.json > $W/torch.txt 2>&1; echo "== torch rc $? $(el)"; tail -8 $W/torch.txt; }
fits 60 && { timeout 150 compute-sanitizer --tool memcheck $B/test_gpu_gating_v2 "*activation*" > $W/memcheck.txt 2>&1; echo "== memcheck $(el)"; tail -n 2 $W/memcheck.txt; }
fits 60 && { timeout 150 compute-sanitizer --tool racecheck $B/test_gpu_gating_v2 "*activation*" > $W/racecheck.txt 2>&1; echo "== racecheck $(el)"; tail -n 2 $W/racecheck.txt; }
fits 30 && { /usr/local/cuda/bin/cuobjdump -sass $B/bench_gating_v2 | awk '/Function : .*activation_topk/{p=1} /Function : /&&!/activation_topk/{p=0} p' > $W/v2_sass.txt 2>&1; }
