# Call Y: the late rule's plan (AB) against HEAD on the stream bench, two
# rounds; the decode tests at AB in parallel shards, the late TopK tests under
# memcheck and racecheck; the gating kernel's SASS and per-instruction counts.
# Everything lands in one archive ($OUT/y.tgz).
R=$(pwd); S=$R/build/sess; T0=$(date +%s); D=${D:-420}
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin; mkdir -p $B && tar xJf $S/by.tar.xz -C $B
F='--batch=8 --context=262144 --benchmark_filter=BM_decode_stream/preset:standard/dtype:bf16/D:128/ --benchmark_out_format=json'
b() { timeout 60 $B/$1 $F --benchmark_out=$W/$2.json > $W/$2.txt 2>&1; echo "rc $? $(el)" >> $W/$2.txt; echo "== $2"; grep -E "^BM_|rc " $W/$2.txt | grep -o 'late[a-z_]*=[0-9.]*[a-z]*\|step_us=[0-9.]*[a-z]*\|rc .*' | paste -sd' '; }
for r in 1 2; do b bench_base base_$r; b bench_AB AB_$r; done
# Tests: Catch2 shards in parallel (each is bound by its fp64 reference on one core).
t() { timeout $3 $B/$1 --durations yes --shard-count $2 --shard-index $4 > $W/$1_$4.txt 2>&1; echo "rc $? $(el)" >> $W/$1_$4.txt; }
for i in 0 1 2 3 4 5; do t test_gpu_attention 6 300 $i & done
for i in 0 1 2; do t test_gpu_select 3 200 $i & done
t test_gpu_fp8_kv 1 200 0 &
t test_gpu_model_decode 1 100 0 &
timeout 330 compute-sanitizer --tool memcheck $B/test_gpu_attention "*a step late*" > $W/memcheck.txt 2>&1 & 
timeout 330 compute-sanitizer --tool racecheck $B/test_gpu_attention "*a step late*" > $W/racecheck.txt 2>&1 &
CO=/usr/local/cuda/bin/cuobjdump
$CO -sass $B/bench_gating | awk '/Function : .*activation_topk/{p=1} /Function : /&&!/activation_topk/{p=0} p' > $W/gating_sass.txt 2>&1
wait
echo "== tests $(el)"; for f in $W/test_*.txt; do echo "$(basename $f): $(grep -E 'All tests passed|test cases:|FAILED' $f | tail -1) $(tail -1 $f)"; done
echo "== sanitizers"; tail -2 $W/memcheck.txt $W/racecheck.txt
if fits 60; then
  timeout 60 /usr/local/cuda/bin/ncu -k regex:activation_topk -s 3 -c 1 --section SourceCounters --section SpeedOfLight --section Occupancy --page source --print-source sass --csv $B/bench_gating --benchmark_filter='BM_activation_topk/rows:4096/n:14336/k_pct:25' > $W/gating_ncu_src.csv 2> $W/gating_ncu.err; echo "ncu rc $? $(el)"; wc -c $W/gating_ncu_src.csv
  timeout 40 /usr/local/cuda/bin/ncu -k regex:activation_topk -s 3 -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats --section SchedulerStats $B/bench_gating --benchmark_filter='BM_activation_topk/rows:4096/n:14336/k_pct:25' > $W/gating_ncu_summary.txt 2>&1; echo "ncu2 rc $? $(el)"
fi
date -u >> $W/when.txt
tar czf $OUT/y.tgz -C $W .
