set -u
bash .peers/install.sh > $OUT/install.log 2>&1; . .peers/env.sh
export PYTHONPATH=$PWD/src:$PWD/.peers-vllm:${PYTHONPATH:-}
export OPENMSA_REVISION=$(cat REVISION)
python3 benchmarks/run.py --sections indexer-decode --quick --dtypes fp8,nvfp4 --batches 1,32,128 --budget-s 400 --out $OUT > $OUT/bench.log 2>&1; tail -5 $OUT/bench.log
python3 benchmarks/profile_case.py --offsets idx-nvfp4-b32-128k idx-fp8-b32-128k > $OUT/offsets.log 2>&1; tail -20 $OUT/offsets.log
