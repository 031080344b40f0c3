#!/usr/bin/env bash
# Session 2026-11-26b, last device call: transport::CudaStaged (the exchange on the device over Tcp
# and SharedMemory, processes sharing the GPU), with the NCCL and codec tests again.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
echo "== test_cuda_sync"; timeout 200 ./test_cuda_sync --no-version -d 2>&1 | tee $OUT/test_cuda_sync.log | grep -v "^\s*$" | tail -25
echo "== test_nccl"; timeout 60 ./test_nccl --no-version 2>&1 | tee $OUT/test_nccl.log | tail -3
echo "== test_cuda"; timeout 60 ./test_cuda --no-version 2>&1 | tee $OUT/test_cuda.log | tail -3
