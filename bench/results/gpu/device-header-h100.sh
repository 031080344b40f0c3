#!/usr/bin/env bash
# Session 2026-11-26b, third kind of device call: decode headers checked on the device (no host
# round trip): the CUDA tests, the NCCL tests, the codec table again, memcheck of the new case.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== test_cuda"; timeout 100 ./test_cuda --no-version 2>&1 | tee $OUT/test_cuda.log | tail -3
echo "== test_nccl"; timeout 100 ./test_nccl --no-version 2>&1 | tee $OUT/test_nccl.log | tail -3
echo "== codecs"; timeout 150 ./codecs --on gpu --min-mib 1 --max-mib 256 --step-factor 4 --iters 20 --json $OUT/codecs-h100-device-header.json 2>&1 | tee $OUT/codecs-h100-device-header.log | grep -E "fp16|two-bit|one-bit|terngrad" 
echo "== memcheck"; timeout 60 compute-sanitizer --tool memcheck --print-limit 20 ./test_cuda --no-version -tc="*wrong header*" 2>&1 | tail -4 | tee $OUT/memcheck.log
