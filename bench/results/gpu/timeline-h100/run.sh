#!/usr/bin/env bash
# (As run: from the repository root on a lent H100, after tools/device-check stage.)
# Session 2026-11-27, fourth device call: where the task graph loses to the serial executor with
# 1 MiB pieces under MPS (10.3 against 8.8 ms in ../replay-h100). The same replay (ResNet-50,
# ef-two-bit, 4 ranks sharing the GPU over shared memory, device codecs through host mirrors),
# 5 iterations after 2 warm-ups, each rank writing its timeline (GRADSYNC_TIMELINE: Chrome trace
# events of ready, bucket, encode, decode, average, send, recv), serial and task graph, under MPS
# and without. Everything goes into $OUT/timeline-h100.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
out=$OUT/timeline-h100
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
run() {  # NAME EXTRA...
  local name=$1; shift
  GRADSYNC_TIMELINE=$out/$name.json timeout 45 python3 tools/gradsync-run -n 4 .device/replay \
    --trace bench/traces/resnet50.trace --codec ef-two-bit --bucketing fixed-size --time-scale 0 --size-scale 1 \
    --iters 5 --warmup 2 --chunk-mib 1 --device "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $?: $(grep -m1 -E '^\[0\] +fixed-size' "$out/$name.log" | cut -c5-)"
}
run contexts-serial --executor serial
run contexts-task-graph --executor task-graph
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && {
  run mps-serial --executor serial
  run mps-task-graph --executor task-graph
  echo quit | nvidia-cuda-mps-control
}
ls -la "$out" | tail -20
tar -czf "$OUT/timeline-h100.tar.gz" -C "$OUT" timeline-h100 && rm -rf "$out"
