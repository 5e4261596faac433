set -u
bash .peers-cute1/stage.sh > $OUT/stage.log 2>&1; tail -1 $OUT/stage.log
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
python3 -m pytest -q -m gpu -k "nvfp4 or request" tests/ops/test_indexer.py tests/test_layer.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
python3 benchmarks/ab.py --base .ab2 --sections indexer-decode --dtypes nvfp4 --contexts 131072,1048576 --batches 1,32 --out $OUT > $OUT/ab.log 2>&1
grep -o "model=.*" $OUT/ab.log | sed 's/section=indexer-decode | //; s/dtype=nvfp4 | //; s/identical=//; s/base_call_us.*//'
tail -1 $OUT/ab.log
