# Activation top-k v5 (57a77f0), v6 (b48804f) and v7 (1efe20d, branch
# gating-v7) against main (50b84af), same call, two rounds; each variant's
# tests and sanitizers; the two GPU cases c6dc3d8 added (rebind keeps the
# planned shape; a cache without summaries is refused) from c6dc3d8's
# test binaries; torch.topk on the same shapes; the decode stream at
# c6dc3d8 (issue 31.1 on this GPU); v7's SASS source counters. One
# archive, $OUT/c4.tgz, rewritten after each phase.
R=$(pwd); S=$R/build/sess; T0=$(date +%s); D=${D:-500}
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
pack() { date -u >> $W/when.txt; tar czf $OUT/c4.tgz -C $W .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin4; mkdir -p $B && tar xJf $S/c4.tar.xz -C $B
G='--benchmark_filter=BM_activation_topk --benchmark_out_format=json'
bench() { for v in main v5 v6 v7; do
  timeout 40 $B/bench_gating_$v $G --benchmark_out=$W/gating_${v}_$1.json > $W/gating_${v}_$1.txt 2>&1
  echo "== $v $1 $(el): $(grep -o 'k_pct:[0-9]*/manual_time\|median_us=[0-9.]*' $W/gating_${v}_$1.txt | paste -sd' ' | sed 's|/manual_time||g')"
done; pack; }
bench 1
{ tar xJf $S/c4_tests.tar.xz -C $B
  timeout 200 $B/test_gpu_attention "decode step replays from a CUDA graph with new queries and tokens" > $W/test_rebind.txt 2>&1; echo "rc $? $(el)" >> $W/test_rebind.txt
  timeout 100 $B/test_gpu_select "decode selection on bf16 slice summaries needs a cache that keeps them" > $W/test_summaries.txt 2>&1; echo "rc $? $(el)" >> $W/test_summaries.txt; } &
for v in v5 v6 v7; do
  { timeout 230 $B/test_gpu_gating_$v --durations yes > $W/test_$v.txt 2>&1; echo "rc $? $(el)" >> $W/test_$v.txt; } &
  timeout 230 compute-sanitizer --tool racecheck $B/test_gpu_gating_$v "*activation*" > $W/racecheck_$v.txt 2>&1 &
  timeout 230 compute-sanitizer --tool memcheck $B/test_gpu_gating_$v "*activation*" > $W/memcheck_$v.txt 2>&1 &
done
wait
echo "== tests $(el)"; tail -n 3 $W/test_v*.txt $W/test_rebind.txt $W/test_summaries.txt; tail -n 2 $W/racecheck_*.txt $W/memcheck_*.txt
pack
fits 90 && { timeout 90 python3 scripts/torch_gating.py $W/torch_gating.json > $W/torch.txt 2>&1; echo "== torch rc $? $(el)"; tail -4 $W/torch.txt; pack; }
if grep -q H200 $W/gpu.txt && fits 80 || fits 200; then
  xz -dc $S/bench_attention.xz > $B/bench_attention && chmod +x $B/bench_attention
  F='--batch=8 --context=262144 --benchmark_filter=BM_decode_stream/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
  timeout 80 $B/bench_attention $F --benchmark_out=$W/stream.json > $W/stream.txt 2>&1; echo "== stream rc $? $(el)"
  grep -E "^BM_" $W/stream.txt | cut -c1-1500; pack
fi
fits 70 && bench 2
if fits 60; then
  timeout 60 /usr/local/cuda/bin/ncu -k regex:activation_topk -s 3 -c 1 --section SourceCounters --section SpeedOfLight --section Occupancy --page source --print-source sass --csv $B/bench_gating_v7 --benchmark_filter='BM_activation_topk/rows:4096/n:14336/k_pct:25' > $W/ncu_v7.csv 2> $W/ncu.err; echo "ncu rc $? $(el)"; xz -6 $W/ncu_v7.csv
fi
echo "== done $(el)"
