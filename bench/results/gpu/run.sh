#!/usr/bin/env bash
# Device checks for gradsync on a lent GPU machine: the CUDA tests, then bench/codecs' GPU table.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee $OUT/gpu.txt
uname -r >> $OUT/gpu.txt
echo "== test_cuda"
timeout 120 ./test_cuda --no-version 2>&1 | tee $OUT/test_cuda.log | tail -15
echo "== codecs"
timeout 200 ./codecs --on gpu --min-mib 1 --max-mib 256 --step-factor 4 --iters 20 --json $OUT/codecs-gpu.json 2>&1 | tee $OUT/codecs-gpu.log
echo "== memcheck"
timeout 120 compute-sanitizer --tool memcheck --print-limit 20 ./test_cuda --no-version -tc="*error feedback*,*CPU codecs*" 2>&1 | tail -20 | tee $OUT/memcheck.log
