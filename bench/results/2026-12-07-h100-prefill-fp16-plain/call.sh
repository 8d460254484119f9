# The call behind this folder (device tool, H100, 2026-12-07 23:50 UTC),
# run as `source .deps/prelude.sh && D=470 bash build/sess/x.sh` with the
# binaries below packed in build/sess/bins.tar.xz: test_gpu_prefill_select,
# test_gpu_prefill_attention, bench_select, bench_prefill built from the
# working tree of 7b36894's kernels (bench_select_base: c665e9d's).
R=$(pwd); S=$R/build/sess; T0=$(date +%s); D=${D:-560}
W=$(mktemp -d); el() { echo $(( $(date +%s) - T0 ))s; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -lt $D ]; }
pack() { date -u >> $W/when.txt; tar czf $OUT/p2.tgz -C $W .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
date -u > $W/when.txt; cat $W/gpu.txt
B=$S/bin; mkdir -p $B && tar xJf $S/bins.tar.xz -C $B
SEL='--benchmark_filter=BM_prefill_selection/T:(262144|32768)/scoring:[23]/stages:1 --benchmark_out_format=json'
ab() { timeout 60 $B/bench_select $SEL --benchmark_out=$W/select_new_$1.json > $W/select_new_$1.txt 2>&1
  timeout 60 $B/bench_select_base $SEL --benchmark_out=$W/select_base_$1.json > $W/select_base_$1.txt 2>&1
  echo "== select round $1 $(el)"; grep -hE "^BM_" $W/select_*_$1.txt | sed 's|/manual_time||' | awk '{print $1, $2}'; pack; }
ab 1
{ timeout 300 $B/test_gpu_prefill_select --durations yes > $W/test_select.txt 2>&1; echo "rc $? $(el)" >> $W/test_select.txt; } &
{ timeout 400 $B/test_gpu_prefill_attention --durations yes > $W/test_attention.txt 2>&1; echo "rc $? $(el)" >> $W/test_attention.txt; } &
{ timeout 300 compute-sanitizer --tool memcheck $B/test_gpu_prefill_select > $W/memcheck.txt 2>&1; echo "rc $? $(el)" >> $W/memcheck.txt; } &
{ timeout 300 compute-sanitizer --tool racecheck $B/test_gpu_prefill_select "prefill selection matches the reference tile by tile" > $W/racecheck.txt 2>&1; echo "rc $? $(el)" >> $W/racecheck.txt; } &
wait
echo "== tests and sanitizers $(el)"; tail -n 4 $W/test_select.txt $W/test_attention.txt $W/memcheck.txt $W/racecheck.txt
pack
ab 2
ab 3
if fits 90; then
  mkdir -p /tmp/kept
  HISPARSE_DUMP_KEPT=/tmp/kept timeout 90 $B/bench_prefill --context=8192,16384,262144 --benchmark_filter='^(BM_prefill/|BM_tensor_core_peak)' --benchmark_min_time=0.2 --benchmark_out_format=json --benchmark_out=$W/prefill.json > $W/prefill.txt 2>&1
  echo "== prefill rc $? $(el)"; grep -E "^BM_" $W/prefill.txt | cut -c1-250; pack
fi
if fits 20; then
  K='_ZN8hisparse6select6detail24prefill_selection_kernelI13__nv_bfloat16Li128ELb0ELNS1_15prefill_scoringE3EEEvNS1_14prefill_paramsIT_EE'
  /usr/local/cuda/bin/cuobjdump -sass -fun "$K" $B/bench_select > $W/sass_f16.txt 2>&1
  grep -o "HMMA\.[0-9A-Z.]*" $W/sass_f16.txt | sort | uniq -c; grep -c "LDL\|STL" $W/sass_f16.txt; xz -6 $W/sass_f16.txt
fi
if fits 70; then
  N=/usr/local/cuda/bin/ncu; F='--benchmark_filter=BM_prefill_selection/T:262144/scoring:3/stages:1/ --benchmark_min_time=0.01'
  timeout 70 $N --clock-control none -k regex:prefill_selection_kernel -s 1 -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section SourceCounters --page source --print-source sass --csv $B/bench_select $F > $W/ncu_f16_source.csv 2> $W/ncu.err
  echo "ncu rc $? $(el)"; xz -6 $W/ncu_f16_source.csv; pack
fi
if fits 40; then
  timeout 40 $N --clock-control none -k regex:prefill_selection_kernel -s 1 -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis $B/bench_select $F > $W/ncu_f16_details.txt 2>> $W/ncu.err
  echo "ncu2 rc $? $(el)"; grep -E "Throughput|Stall|Occupancy|Warp Cycles|Issued" $W/ncu_f16_details.txt | head -30
fi
echo "== done $(el)"
