#!/usr/bin/env bash
# Nsight Compute over named cases of benchmarks/profile_case.py (one device call; clocks left
# alone). Writes one text report per case under $OUT.
#   bash scripts/ncu_cases.sh attn-fp8-tp4-b128:_sparse_attention idx-fp8-b32-128k:_block_scores
#   bash scripts/ncu_cases.sh idx-fp8-prefill-120k:_block_scores:3   # case:kernel[:launches to skip]
# (the prefill cases' tile launch is every second _block_scores launch; the L2 question of
# docs/performance.md is answered by the MemoryWorkloadAnalysis section's L2 throughput)
set -uo pipefail
OUT=${OUT:-/tmp/openmsa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
for spec in "$@"; do
  IFS=: read -r name kernel skip <<< "$spec"
  ncu --clock-control none -k "regex:$kernel" --launch-skip "${skip:-2}" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      python3 benchmarks/profile_case.py "$name" 4 > "$OUT/ncu-$name.txt" 2>&1
  echo "== $name: rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit|Dynamic Shared|Block Limit" "$OUT/ncu-$name.txt" | head -16
done
