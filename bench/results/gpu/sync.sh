#!/usr/bin/env bash
# Device check: the Synchronizer on device gradients (several processes sharing the GPU).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 ./test_cuda_sync --no-version -d 2>&1 | tee $OUT/test_cuda_sync.log | grep -v "^\s*$" | tail -30
