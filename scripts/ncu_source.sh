#!/usr/bin/env bash
# Nsight Compute's per-instruction view (SASS with its source counters: shared-memory wavefronts
# and their excess, i.e. bank conflicts; warp stalls) of one kernel launch of a named case of
# benchmarks/profile_case.py, as CSV under $OUT (one device call; clocks left alone):
#   bash scripts/ncu_source.sh attn-fp8-tp1-prefill-shared:_sparse_attention_tile_gluon:2
# then, here: python3 scripts/ncu_source_top.py <files_at>/src-attn-fp8-tp1-prefill-shared.csv
set -uo pipefail
OUT=${OUT:-/tmp/openmsa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
for spec in "$@"; do
  IFS=: read -r name kernel skip <<< "$spec"
  ncu --clock-control none -k "regex:$kernel" --launch-skip "${skip:-2}" --launch-count 1 \
      --section SourceCounters --section WarpStateStats -o "$OUT/rep-$name" \
      python3 benchmarks/profile_case.py "$name" 4 > "$OUT/log-$name.txt" 2>&1
  echo "== $name: rc=$?"
  ncu -i "$OUT/rep-$name.ncu-rep" --page source --print-source sass --csv \
      > "$OUT/src-$name.csv" 2> "$OUT/src-$name.err"
  echo "   source page rc=$? lines=$(wc -l < "$OUT/src-$name.csv")"
  # (the device tool brings back only a few files per call: the report and logs stay there)
  rm -f "$OUT/rep-$name.ncu-rep" "$OUT/src-$name.err" "$OUT/log-$name.txt"
done
