#!/usr/bin/env bash
# One device call: the GPU test tier, then (optionally) the benchmark. Run from the repo root on
# the GPU machine; results land in $OUT (the device tool brings them back).
#   bash scripts/gpu_check.sh tests            # tier 2 + tier 1 on the GPU (168 tests; 502 s
#                                              # at 3728589: give the call 600)
#   bash scripts/gpu_check.sh tests-part I/N   # every N-th test of that tier from the I-th
#                                              # (the whole tier took over 600 s at e0afd54 on
#                                              # a fresh machine: two calls with 1/2 and 2/2)
#   bash scripts/gpu_check.sh bench [args...]  # benchmarks/run.py with args
#   bash scripts/gpu_check.sh tune [args...]   # benchmarks/tune.py with args (appends tune.log)
#   bash scripts/gpu_check.sh ab [args...]     # benchmarks/ab.py: this tree against .ab's base
#                                              # (python3 benchmarks/prepare_ab.py REV first)
#   bash scripts/gpu_check.sh host [cases...]  # benchmarks/host_cost.py (eager calls' host time)
# The device copy has no .git: write the commit first (`git rev-parse --short HEAD > REVISION`
# and name REVISION in the call's carry) so the benchmark's provenance line names it.
set -uo pipefail
OUT=${OUT:-/tmp/openmsa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
[ -f REVISION ] && export OPENMSA_REVISION=$(cat REVISION)
what=${1:-tests}
shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
case "$what" in
  tests)
    python3 -m pytest -q -x --durations=20 -m "gpu or interpret" tests "$@" 2>&1 \
      | tee "$OUT/tests.log" ;;
  tests-part)
    part=${1%/*}; parts=${1#*/}; shift
    python3 -m pytest -q --collect-only -m "gpu or interpret" tests 2>/dev/null | grep '::' \
      > "$OUT/test-ids.txt"
    mapfile -t ids < <(awk -v p="$part" -v n="$parts" '(NR - p) % n == 0' "$OUT/test-ids.txt")
    echo "part $part of $parts: ${#ids[@]} tests" | tee "$OUT/tests-$part.log"
    python3 -m pytest -q --durations=20 "${ids[@]}" "$@" 2>&1 | tee -a "$OUT/tests-$part.log" ;;
  ab)
    python3 benchmarks/ab.py --base .ab --out "$OUT" "$@" 2>&1 | tee -a "$OUT/ab.log" ;;
  bench)
    python3 benchmarks/run.py "$@" 2>&1 | tee "$OUT/bench.log" ;;
  tune)
    python3 benchmarks/tune.py "$@" 2>&1 | tee -a "$OUT/tune.log" ;;
  host)
    python3 benchmarks/host_cost.py "$@" 2>&1 | tee -a "$OUT/host.log" ;;
  all)
    python3 -m pytest -q -m "gpu or interpret" tests 2>&1 | tee "$OUT/tests.log"
    python3 benchmarks/run.py "$@" 2>&1 | tee "$OUT/bench.log" ;;
esac
