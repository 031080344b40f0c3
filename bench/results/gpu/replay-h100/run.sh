#!/usr/bin/env bash
# (As run: from the repository root on a lent H100, after tools/device-check stage: the programs
# and their libraries in .device/, ../shared/tools/netcluster copied to .device/netcluster.)
# Session 2026-11-27, second device call. bench/replay on ResNet-50's gradients (full size, all
# ready at once, ef-two-bit, fixed-size 25 MiB buckets), 4 ranks sharing the one GPU:
#  1. on one machine (gradsync-run -n 4: shared memory between the ranks), device codecs through
#     host mirrors and through CUDA IPC, serial and task graph, 1 and 8 MiB pieces; first as the
#     GPU is (each process a context of its own, time-sliced), then under MPS (one context for
#     all), two rounds each. The first call found IPC 1.7-5.8x slower than the mirrors.
#  2. on 4 emulated hosts at 1 Gbit/s (netcluster: TCP between the ranks), host codecs against
#     device codecs, serial and task graph, 1 and 8 MiB pieces, two rounds; if netcluster cannot
#     come up there, the same over loopback TCP (gradsync-run --machines 4).
# Everything it writes goes into $OUT/replay-h100.tar.gz; it stops starting runs at STOP_AT s.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
out=$OUT/replay-h100 stop_at=${STOP_AT:-300}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n') GRADSYNC_TCP_CONGESTION=cubic
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$out/gpu.txt"
common=(--trace bench/traces/resnet50.trace --codec ef-two-bit --bucketing fixed-size --time-scale 0 --size-scale 1
        --iters 10 --warmup 3)

# replay NAME LAUNCHER... -- EXTRA...: one run, its log and JSON under $out, rank 0's line printed.
replay() {
  local name=$1; shift
  local launcher=() extra=()
  while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
  shift; extra=("$@")
  if (( SECONDS > stop_at )); then echo "$name: not run, out of time"; return; fi
  timeout 45 "${launcher[@]}" .device/replay "${common[@]}" "${extra[@]}" --json "$out/$name.json" >"$out/$name.log" 2>&1
  echo "$name: exit $?: $(grep -m1 -E '^\[0\] +fixed-size' "$out/$name.log" | cut -c5-)"
}

configs() {  # NAME-PREFIX LAUNCHER... : the configurations of part 1 or 2
  local prefix=$1; shift
  for round in 1 2; do
    for chunk in 1 8; do
      for config in $CONFIGS; do
        local extra=(--chunk-mib $chunk)
        case $config in
          host-serial) extra+=(--executor serial) ;;
          host-task-graph) extra+=(--executor task-graph) ;;
          device-serial) extra+=(--device --executor serial) ;;
          device-task-graph) extra+=(--device --executor task-graph) ;;
          ipc-serial) extra+=(--device --ipc --executor serial) ;;
          ipc-task-graph) extra+=(--device --ipc --executor task-graph) ;;
        esac
        replay "$prefix-chunk$chunk-$config-$round" "$@" -- "${extra[@]}"
      done
    done
  done
}

echo "== 1. one machine, no MPS"
CONFIGS="device-serial device-task-graph ipc-serial ipc-task-graph" configs local python3 tools/gradsync-run -n 4

echo "== 1. one machine, MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  CONFIGS="device-serial device-task-graph ipc-serial ipc-task-graph" configs mps python3 tools/gradsync-run -n 4
  echo "== test_cuda_sync's IPC cases under MPS"
  timeout 60 .device/test_cuda_sync -tc="*CUDA IPC*" --no-version -d >"$out/test_cuda_sync-mps.log" 2>&1
  echo "exit $?" >>"$out/test_cuda_sync-mps.log"
  grep -E "^\[doctest\] (test cases|Status)|ERROR|FAILED|exit " "$out/test_cuda_sync-mps.log" | tail -6
  echo quit | nvidia-cuda-mps-control
  cp -r /tmp/mps-log "$out/" 2>/dev/null
  sleep 2
else
  echo "MPS: nvidia-cuda-mps-control is not there or did not start" | tee "$out/mps.txt"
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

echo "== 2. four hosts"
if .device/netcluster up 4 1gbit >"$out/netcluster.log" 2>&1; then
  cat "$out/netcluster.log"
  CONFIGS="host-serial host-task-graph device-serial device-task-graph" configs netcluster-4x1gbit .device/netcluster run 4
  .device/netcluster down >/dev/null 2>&1
else
  tail -3 "$out/netcluster.log"
  CONFIGS="host-serial host-task-graph device-serial device-task-graph" configs tcp-loopback python3 tools/gradsync-run -n 1 --machines 4
fi
tar -czf "$OUT/replay-h100.tar.gz" -C "$OUT" replay-h100 && rm -rf "$out"
