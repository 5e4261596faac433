#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT ($OUT/a/b/file at the deepest), each at
# most 16 MiB: when a call leaves more files or deeper ones, everything under $OUT is packed
# into one $OUT/out.tgz (unpack with `tar xzf out.tgz`), unless the archive would be too large
# to come back, in which case the files stay as they are. gpu_check.sh and ncu_cases.sh run
# this at exit; an ad-hoc device command can end with `bash scripts/pack_out.sh`.
OUT=${OUT:-/tmp/openmsa-out}
[ -d "$OUT" ] || exit 0
files=$(find "$OUT" -type f | wc -l)
deep=$(find "$OUT" -mindepth 4 -type f | wc -l)
if [ "$files" -gt 8 ] || [ "$deep" -gt 0 ]; then
  tmp=$(mktemp /tmp/openmsa-out-XXXXXX.tgz)
  if tar czf "$tmp" -C "$OUT" . && [ "$(stat -c %s "$tmp")" -le $((16 * 1024 * 1024)) ]; then
    find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/out.tgz"
    echo "pack_out.sh: $files files under $OUT packed into $OUT/out.tgz"
  else
    rm -f "$tmp"
    echo "pack_out.sh: $files files under $OUT, too large to pack into one; left as they are"
  fi
fi
