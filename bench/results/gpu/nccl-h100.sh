#!/usr/bin/env bash
# Session 2026-11-26b, second device call: transport::Nccl and the device exchange, and the CUDA tests again.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== test_nccl"; timeout 150 ./test_nccl --no-version -d 2>&1 | tee $OUT/test_nccl.log | grep -v "^\s*$" | tail -30
echo "== test_cuda_sync"; timeout 120 ./test_cuda_sync --no-version 2>&1 | tee $OUT/test_cuda_sync.log | tail -3
echo "== test_cuda"; timeout 100 ./test_cuda --no-version 2>&1 | tee $OUT/test_cuda.log | tail -3
