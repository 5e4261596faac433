#!/usr/bin/env bash
# Nsight Compute over named cases of benchmarks/profile_case.py (one device call; clocks left
# alone). Writes one text report per case under $OUT.
#   bash scripts/ncu_cases.sh attn-fp8-tp4-b128:_sparse_attention idx-fp8-b32-128k:_block_scores
#   bash scripts/ncu_cases.sh idx-fp8-prefill-120k:_block_scores:3   # case:kernel[:launches to skip]
#   NCU_SOURCE=1 bash scripts/ncu_cases.sh ...   # also each SASS instruction's executions and
#                                                # stall samples (ncu-<case>-sass.csv)
#   NCU_METRICS=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,... adds metrics
#   (OPENMSA_TUNING='{...}' in the environment profiles a variant)
# (the prefill cases' prefill launch is every second _block_scores launch; the L2 question of
# docs/performance.md is answered by the MemoryWorkloadAnalysis section's L2 throughput)
set -uo pipefail
OUT=${OUT:-/tmp/openmsa-out}
# at exit: more files than the device tool brings back are packed into $OUT/out.tgz
trap 'OUT="$OUT" bash "$(dirname "$0")/pack_out.sh"' EXIT
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
for spec in "$@"; do
  IFS=: read -r name kernel skip <<< "$spec"
  ncu --clock-control none -k "regex:$kernel" --launch-skip "${skip:-2}" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      ${NCU_METRICS:+--metrics "$NCU_METRICS"} -f -o "$OUT/ncu-$name" \
      python3 benchmarks/profile_case.py "$name" 4 > "$OUT/ncu-$name.log" 2>&1
  rc=$?
  ncu -i "$OUT/ncu-$name.ncu-rep" --page details > "$OUT/ncu-$name.txt" 2>&1
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    ncu -i "$OUT/ncu-$name.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/ncu-$name-sass.csv" 2>&1
  fi
  rm -f "$OUT/ncu-$name.ncu-rep"
  echo "== $name: rc=$rc"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit|Dynamic Shared|Block Limit" "$OUT/ncu-$name.txt" | head -16
done
