# Call 1 (2026-12-07 session 2): gating-store-bound (a9ed89a) and v4 (its
# predicated compares, bf16 widened from the raw words) against main's
# kernel (same call, two rounds), its tests and sanitizers, its per-SASS
# counters; torch.topk on the same shapes; the decode stream at HEAD (the
# late TopK rule's step on this GPU); the retention case at HEAD (3a65814's
# mend). One archive, $OUT/c1.tgz, rewritten after each phase.
R=$(pwd); S=$R/build/sess; T0=$(date +%s); D=${D:-540}
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
pack() { date -u >> $W/when.txt; tar czf $OUT/c1.tgz -C $W .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin; mkdir -p $B && tar xJf $S/c1.tar.xz -C $B
G='--benchmark_filter=BM_activation_topk --benchmark_out_format=json'
for r in 1 2; do for v in main sb v4; do
  timeout 40 $B/bench_gating_$v $G --benchmark_out=$W/gating_${v}_$r.json > $W/gating_${v}_$r.txt 2>&1
  echo "== $v $r $(el): $(grep -o 'k_pct:[0-9]*/manual_time\|median_us=[0-9.]*' $W/gating_${v}_$r.txt | paste -sd' ' | sed 's|/manual_time||g')"
done; done
F='--batch=8 --context=262144 --benchmark_filter=BM_decode_stream/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
timeout 60 $B/bench_attention $F --benchmark_out=$W/stream.json > $W/stream.txt 2>&1; echo "== stream rc $? $(el)"
grep -E "^BM_" $W/stream.txt | grep -o 'late[a-z_]*=[0-9.]*[a-z]*\|step_us=[0-9.]*[a-z]*' | paste -sd' '
timeout 90 python3 scripts/torch_gating.py $W/torch_gating.json > $W/torch.txt 2>&1; echo "== torch rc $? $(el)"; tail -4 $W/torch.txt
pack
for v in sb v4; do { timeout 200 $B/test_gpu_gating_$v --durations yes > $W/test_$v.txt 2>&1; echo "rc $? $(el)" >> $W/test_$v.txt; } & done
{ timeout 250 $B/test_gpu_attention "retention*" --durations yes > $W/retention.txt 2>&1; echo "rc $? $(el)" >> $W/retention.txt; } &
for v in sb v4; do
  timeout 250 compute-sanitizer --tool racecheck $B/test_gpu_gating_$v "*activation*" > $W/racecheck_$v.txt 2>&1 &
  timeout 250 compute-sanitizer --tool memcheck $B/test_gpu_gating_$v "*activation*" > $W/memcheck_$v.txt 2>&1 &
done
wait
echo "== tests $(el)"; tail -n 3 $W/test_sb.txt $W/test_v4.txt $W/retention.txt; tail -n 2 $W/racecheck_*.txt $W/memcheck_*.txt
pack
if fits 70; then
  timeout 70 /usr/local/cuda/bin/ncu -k regex:activation_topk -s 3 -c 1 --section SourceCounters --section SpeedOfLight --section Occupancy --page source --print-source sass --csv $B/bench_gating_v4 --benchmark_filter='BM_activation_topk/rows:4096/n:14336/k_pct:25' > $W/ncu_src.csv 2> $W/ncu.err; echo "ncu rc $? $(el)"; wc -c $W/ncu_src.csv
  xz -6 $W/ncu_src.csv
fi
