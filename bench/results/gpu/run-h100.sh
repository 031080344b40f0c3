#!/usr/bin/env bash
# Session 2026-11-26b, first device call: existing CUDA tests, codec table on the H100, memcheck, NCCL probe.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -r; nvcc --version | tail -2; } 2>&1 | tee $OUT/gpu.txt
echo "== test_cuda"; timeout 120 ./test_cuda --no-version 2>&1 | tee $OUT/test_cuda.log | tail -4
echo "== test_cuda_sync"; timeout 150 ./test_cuda_sync --no-version 2>&1 | tee $OUT/test_cuda_sync.log | tail -4
echo "== nccl"
NL=$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -3); echo "$NL" | tee $OUT/nccl.txt
LD_LIBRARY_PATH=$PWD/lib:$(dirname "$(echo "$NL" | head -1)") timeout 90 ./nccl_probe 2>&1 | tee -a $OUT/nccl.txt
echo "== codecs"; timeout 150 ./codecs --on gpu --min-mib 1 --max-mib 256 --step-factor 4 --iters 20 --json $OUT/codecs-h100.json 2>&1 | tee $OUT/codecs-h100.log | tail -40
echo "== memcheck"; timeout 80 compute-sanitizer --tool memcheck --print-limit 20 ./test_cuda --no-version -tc="*error feedback*,*CPU codecs*" 2>&1 | tail -6 | tee $OUT/memcheck.log
