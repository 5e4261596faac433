#!/usr/bin/env bash
# One device call: the GPU test tier, then (optionally) the benchmark. Run from the repo root on
# the GPU machine; results land in $OUT (the device tool brings them back).
#   bash scripts/gpu_check.sh tests            # tier 2 + tier 1 on the GPU (168 tests; 502 s
#                                              # at 3728589: give the call 600)
#   bash scripts/gpu_check.sh tests-n N [paths]  # the tier (or the paths) over N pytest-xdist
#                                              # workers: compilation dominates and the machine
#                                              # has 16 cores (-v log in $OUT/tests.log, so a
#                                              # call cut by its limit still says what ran)
#   bash scripts/gpu_check.sh tests-part I/N   # every N-th test of that tier from the I-th
#                                              # (the whole tier took over 600 s at e0afd54 on
#                                              # a fresh machine: two calls with 1/2 and 2/2)
#   bash scripts/gpu_check.sh bench [args...]  # benchmarks/run.py with args (bench.json and
#                                              # bench.log in $OUT)
#   bash scripts/gpu_check.sh bench-part I [args...]  # part I of 4 of the full comparison, each
#                                              # one device call (into $OUT/bench-I; no new
#                                              # case starts after 540 s: BENCH_BUDGET_S):
#                                              # 1 indexer-decode TP1; 2 indexer-decode TP4;
#                                              # 3 indexer-prefill, attention-decode;
#                                              # 4 attention-prefill, layer-decode, layer-prefill.
#                                              # Then, here: python3 benchmarks/plot.py
#                                              # DIR/bench-*/bench.json (and perf_doc.py)
# The peers: FlashInfer 0.7.4 from the machine's Python, and vLLM 0.34's MiniMax-M3 kernels from
# .peers-vllm (made by the shared tool prepare-vllm-peer.sh; name .peers-vllm in the call's
# carry): this script puts it first on PYTHONPATH. Without it the vLLM columns read "absent".
#   bash scripts/gpu_check.sh extras           # the pass's rest: stack.py, host_cost.py,
#                                              # transformers_memory.py (into $OUT)
# FlashInfer: a first call installs it (`bash .peers/install.sh`, see docs/contributing.md);
# later calls on the same machine find it in /tmp/peers and put it on the path themselves.
#   bash scripts/gpu_check.sh nvfp4 [cases...]  # issue 41: the NVFP4 GPU tests, then
#                                              # profile_case.py --breakdown of NVFP4 decode
#                                              # cases beside fp8 (or the cases named)
#   bash scripts/gpu_check.sh bounds [pytest args...]  # issue 56: the hostile-metadata tests
#                                              # (tests/ops/test_*_bounds.py), the interpreter
#                                              # tier's cast tests and topk-1 selections on the
#                                              # GPU, then scripts/hostile_step.py plain and
#                                              # under compute-sanitizer memcheck (Firecracker
#                                              # machines; gVisor refuses the device)
#   bash scripts/gpu_check.sh tune [args...]   # benchmarks/tune.py with args (appends tune.log)
#   bash scripts/gpu_check.sh ab [args...]     # benchmarks/ab.py: this tree against .ab's base
#                                              # (python3 benchmarks/prepare_ab.py REV first)
#   bash scripts/gpu_check.sh layer-ab         # issue 57's A/B in one call (~2 min warm): the
#                                              # layer step TP1 fp8 at B = 1 (q_len 1, 4) and
#                                              # 8, 32K-1M, with both trees' kernels; then the
#                                              # large rows that may lose no more than 2%
#                                              # (indexer and layer, B = 32 / 128, 128K and 1M)
#   bash scripts/gpu_check.sh host [cases...]  # benchmarks/host_cost.py (eager calls' host time)
#   bash scripts/gpu_check.sh small-steps      # issue 57's before/after in one call (~6 min):
#                                              # .ab's base against this tree, the layer step
#                                              # (TP1 and TP4 fp8, B = 1 and 8) and the
#                                              # attention alone (TP1-TP8, bf16 and fp8, B = 1
#                                              # and 8), then the 57-layer stack at B = 1 beside
#                                              # FlashInfer's calls (needs .peers)
#   bash scripts/gpu_check.sh latency          # issue 57's where-the-time-goes, one call (~4 min):
#                                              # benchmarks/launch_floor.py (a chain of empty
#                                              # launches), profile_case.py --offsets of the
#                                              # B = 1 layer steps, and Nsight Compute over each
#                                              # kernel of the 32K and 128K steps (alone, cold)
#   bash scripts/gpu_check.sh multigpu [args...]  # issue 43, on 2-4 GPUs (nvidia-h200-x2/-x4):
#                                              # tests/test_multigpu.py (NCCL, world 2 and 4),
#                                              # then benchmarks/cp_multigpu.py at W = 2 and, with
#                                              # 4+ GPUs, W = 4 (args go to the benchmark);
#                                              # logs and cp_multigpu-w*.json in $OUT/multigpu.
#                                              # multigpu-tests / multigpu-bench run one half
#                                              # (two device calls if one call's 600 s is short)
# The device copy has no .git: write the commit first (`git rev-parse --short HEAD > REVISION`
# and name REVISION in the call's carry) so the benchmark's provenance line names it.
set -uo pipefail
OUT=${OUT:-/tmp/openmsa-out}
# at exit: more files than the device tool brings back are packed into $OUT/out.tgz
trap 'OUT="$OUT" bash "$(dirname "$0")/pack_out.sh"' EXIT
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
[ -d .peers-vllm ] && export PYTHONPATH=$PWD/.peers-vllm:$PYTHONPATH
# FlashInfer, once a call has installed it on this machine (.peers/install.sh): on the path, with
# its dense attention sources where .peers-fi-dense came along
if [ -d /tmp/peers/flashinfer ]; then
  [ -d .peers-fi-dense ] && [ ! -f /tmp/peers/flashinfer/data/csrc/batch_prefill.cu ] \
    && bash .peers-fi-dense/install.sh
  . "$(dirname "$0")/../.peers/env.sh" 2>/dev/null \
    || export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1
[ -f REVISION ] && export OPENMSA_REVISION=$(cat REVISION)
what=${1:-tests}
shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
case "$what" in
  tests)
    python3 -m pytest -q -x --durations=20 -m "gpu or interpret" tests "$@" 2>&1 \
      | tee "$OUT/tests.log" ;;
  tests-n)
    n=${1:-8}; shift || true
    [ $# -gt 0 ] || set -- tests
    python3 -m pytest -v -n "$n" -p no:benchmark -rfE -m "gpu or interpret" "$@" \
      > "$OUT/tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30 ;;
  tests-part)
    part=${1%/*}; parts=${1#*/}; shift
    python3 -m pytest -q --collect-only -m "gpu or interpret" tests 2>/dev/null | grep '::' \
      > "$OUT/test-ids.txt"
    mapfile -t ids < <(awk -v p="$part" -v n="$parts" '(NR - p) % n == 0' "$OUT/test-ids.txt")
    echo "part $part of $parts: ${#ids[@]} tests" | tee "$OUT/tests-$part.log"
    python3 -m pytest -q --durations=20 "${ids[@]}" "$@" 2>&1 | tee -a "$OUT/tests-$part.log" ;;
  bounds)
    python3 -m pytest -q -m "gpu or interpret" tests/ops/test_indexer_bounds.py \
      tests/ops/test_attention_bounds.py tests/ops/test_cache_bounds.py tests/test_interpreter.py \
      "$@" 2>&1 | tee "$OUT/bounds-tests.log"
    timeout 200 python3 scripts/hostile_step.py 2>&1 | tee "$OUT/hostile.log"
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 scripts/hostile_step.py > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit status $?" | tee -a "$OUT/memcheck.log"
    grep -E "ERROR SUMMARY|Invalid|mismatches" "$OUT/memcheck.log" | head -20 ;;
  ab)
    python3 benchmarks/ab.py --base .ab --out "$OUT" "$@" 2>&1 | tee -a "$OUT/ab.log" ;;
  layer-ab)
    mkdir -p "$OUT/small" "$OUT/large"
    python3 benchmarks/ab.py --base .ab --out "$OUT/small" --sections layer-decode \
      --models m3-tp1 --dtypes fp8 --batches 1,8 --iters 30 2>&1 | tee "$OUT/small/ab.log"
    python3 benchmarks/ab.py --base .ab --out "$OUT/large" --sections indexer-decode,layer-decode \
      --models m3-tp1 --dtypes fp8 --batches 32,128 --contexts 131072,1048576 --q-lens 1 \
      --iters 20 2>&1 | tee "$OUT/large/ab.log" ;;
  bench)
    python3 benchmarks/run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" ;;
  extras)
    # the full pass's rest, one call (~90 s warm): the 57-layer stack at B = 1 beside
    # FlashInfer's, the host cost, transformers' model on openmsa up to 1M
    python3 benchmarks/stack.py --contexts 131072,1048576 --batch 1 --model m3-tp1 --dtype fp8 \
      --out "$OUT" 2>&1 | tee "$OUT/stack.log"
    python3 benchmarks/host_cost.py --out "$OUT/host.json" 2>&1 | tee "$OUT/host.log" | tail -20
    python3 benchmarks/transformers_memory.py --out "$OUT/transformers.json" \
      --lengths 8192,32768,131072,1048576 2>&1 | tee "$OUT/transformers.log" ;;
  bench-part)
    part=${1:?bench-part needs a part number, 1-4}; shift
    case "$part" in
      1) sel=(--sections indexer-decode --models m3-tp1) ;;
      2) sel=(--sections indexer-decode --models m3-tp4) ;;
      3) sel=(--sections indexer-prefill,attention-decode) ;;
      4) sel=(--sections attention-prefill,layer-decode,layer-prefill) ;;
      *) echo "bench-part: part must be 1-4, got $part" >&2; exit 2 ;;
    esac
    mkdir -p "$OUT/bench-$part"
    python3 benchmarks/run.py "${sel[@]}" --budget-s "${BENCH_BUDGET_S:-540}" \
      --out "$OUT/bench-$part" "$@" 2>&1 | tee "$OUT/bench-$part/bench.log" ;;
  nvfp4)
    python3 -m pytest -q -m gpu -k nvfp4 tests/ops/test_indexer.py tests/ops/test_cache.py \
      tests/test_layer.py 2>&1 | tee "$OUT/nvfp4-tests.log"
    [ $# -gt 0 ] || set -- idx-nvfp4-b128-1m idx-fp8-b128-1m idx-nvfp4-b1-1m idx-nvfp4-b32-128k \
      idx-nvfp4-b128-32k-q4 idx-nvfp4-b64-128k-tp4
    python3 benchmarks/profile_case.py --breakdown "$@" 2>&1 | tee "$OUT/nvfp4-breakdown.log" ;;
  tune)
    python3 benchmarks/tune.py "$@" 2>&1 | tee -a "$OUT/tune.log" ;;
  small-steps)
    mkdir -p "$OUT/layer" "$OUT/attention"
    python3 benchmarks/ab.py --base .ab --out "$OUT/layer" --sections layer-decode \
      --models m3-tp1,m3-tp4 --dtypes fp8 --batches 1,8 --iters 30 2>&1 | tee "$OUT/layer/ab.log"
    python3 benchmarks/ab.py --base .ab --out "$OUT/attention" --sections attention-decode \
      --dtypes bf16,fp8 --batches 1,8 --iters 30 2>&1 | tee "$OUT/attention/ab.log"
    python3 benchmarks/stack.py --contexts 131072,1048576 --batch 1 --model m3-tp1 --dtype fp8 \
      --out "$OUT" 2>&1 | tee "$OUT/stack.log" ;;
  latency)
    python3 benchmarks/launch_floor.py --json "$OUT/launch_floor.json" 2>&1 \
      | tee "$OUT/launch_floor.log"
    python3 benchmarks/profile_case.py --offsets layer-fp8-tp1-b1-32k layer-fp8-tp1-b1-128k \
      layer-fp8-tp1-b1-512k layer-fp8-tp1-b1-1m layer-fp8-tp4-b1-1m layer-fp8-tp1-b8-128k 2>&1 \
      | tee "$OUT/offsets.log"
    # each kernel of one call (the case's first call skipped), alone and L2-flushed (ncu's
    # default cache control); each spec is case:launches per call
    kernels='regex:_prepare_scores|_block_scores|_fused_prepare|_segment_topk|_merge_topk|_sparse_attention_kernel|_merge_splits'
    for spec in layer-fp8-tp1-b1-32k:4 layer-fp8-tp1-b1-128k:6; do
      IFS=: read -r name n <<< "$spec"
      ncu --clock-control none -k "$kernels" --launch-skip "$n" --launch-count "$n" \
          --section SpeedOfLight --section LaunchStats --section Occupancy \
          --section WarpStateStats -f -o "$OUT/ncu-$name" \
          python3 benchmarks/profile_case.py "$name" 3 > "$OUT/ncu-$name.log" 2>&1
      ncu -i "$OUT/ncu-$name.ncu-rep" --page details > "$OUT/ncu-$name.txt" 2>&1
      rm -f "$OUT/ncu-$name.ncu-rep"
      grep -E "^  _|Duration|Registers Per|Grid Size|Stall Long|Warp Cycles Per Issued" \
        "$OUT/ncu-$name.txt" | head -60
    done ;;
  host)
    python3 benchmarks/host_cost.py --out "$OUT/host.json" "$@" 2>&1 | tee -a "$OUT/host.log" ;;
  multigpu|multigpu-tests|multigpu-bench)
    mkdir -p "$OUT/multigpu"
    gpus=$(nvidia-smi -L | grep -c '^GPU')
    echo "$gpus GPUs" | tee "$OUT/multigpu/gpus.txt"
    nvidia-smi topo -m > "$OUT/multigpu/topo.txt" 2>&1
    rc=0
    if [ "$what" != multigpu-bench ]; then
      python3 -m pytest -q -rs --durations=10 tests/test_multigpu.py 2>&1 \
        | tee "$OUT/multigpu/tests.log"
      rc=${PIPESTATUS[0]}
    fi
    if [ "$what" != multigpu-tests ]; then
      for w in 2 4; do
        [ "$gpus" -ge "$w" ] || continue
        python3 benchmarks/cp_multigpu.py --world "$w" --out "$OUT/multigpu" "$@" 2>&1 \
          | tee "$OUT/multigpu/bench-w$w.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done
    fi
    exit $rc ;;
  all)
    python3 -m pytest -q -m "gpu or interpret" tests 2>&1 | tee "$OUT/tests.log"
    python3 benchmarks/run.py "$@" 2>&1 | tee "$OUT/bench.log" ;;
esac
