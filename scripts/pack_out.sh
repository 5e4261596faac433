#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT, none deeper than two folders: when a
# call leaves more (or deeper), everything under $OUT is packed into one $OUT/out.tgz (unpack
# with `tar xzf out.tgz`). gpu_check.sh and ncu_cases.sh run this at exit; an ad-hoc device
# command can end with `bash scripts/pack_out.sh`.
OUT=${OUT:-/tmp/openmsa-out}
[ -d "$OUT" ] || exit 0
files=$(find "$OUT" -type f | wc -l)
deep=$(find "$OUT" -mindepth 3 -type f | wc -l)
if [ "$files" -gt 8 ] || [ "$deep" -gt 0 ]; then
  tmp=$(mktemp /tmp/openmsa-out-XXXXXX.tgz)
  tar czf "$tmp" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/out.tgz"
  echo "pack_out.sh: $files files under $OUT packed into $OUT/out.tgz"
fi
