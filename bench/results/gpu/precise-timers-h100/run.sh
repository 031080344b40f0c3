#!/usr/bin/env bash
# (As run: from the repository root on a lent H100, with the build before detail::precise_timers
# staged in .device-old/ and the build with it in .device/, both by tools/device-check stage.)
# Session 2026-11-27, third device call: the same replay as ../replay-h100 (ResNet-50, ef-two-bit,
# 4 ranks sharing the GPU over shared memory), the two builds in turn, two rounds: device codecs
# through host mirrors on both executors at 1 and 8 MiB pieces, and through CUDA IPC at 8 MiB,
# each process a CUDA context of its own; then the mirrors' runs under MPS. Then the new build's
# CUDA tests. Everything goes into $OUT/precise-timers-h100.tar.gz; no run starts past STOP_AT s.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
out=$OUT/precise-timers-h100 stop_at=${STOP_AT:-200}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; } | tee "$out/gpu.txt"
common=(--trace bench/traces/resnet50.trace --codec ef-two-bit --bucketing fixed-size --time-scale 0 --size-scale 1
        --iters 10 --warmup 3)

# replay NAME BUILD EXTRA...: one run of BUILD's replay (.device or .device-old), rank 0's line printed.
replay() {
  local name=$1 build=$2; shift 2
  if (( SECONDS > stop_at )); then echo "$name: not run, out of time"; return; fi
  LD_LIBRARY_PATH=$PWD/$build/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu timeout 45 \
    python3 tools/gradsync-run -n 4 $build/replay "${common[@]}" "$@" --json "$out/$name.json" >"$out/$name.log" 2>&1
  echo "$name: exit $?: $(grep -m1 -E '^\[0\] +fixed-size' "$out/$name.log" | cut -c5-)"
}

# matrix SETTING CONFIG...: each CONFIG (chunk:path-executor) for both builds in turn, two rounds.
matrix() {
  local setting=$1; shift
  for round in 1 2; do
    for config in "$@"; do
      local chunk=${config%%:*} run=${config#*:} extra=()
      case $run in
        device-serial) extra=(--device --executor serial) ;;
        device-task-graph) extra=(--device --executor task-graph) ;;
        ipc-serial) extra=(--device --ipc --executor serial) ;;
        ipc-task-graph) extra=(--device --ipc --executor task-graph) ;;
      esac
      for build in old new; do
        local dir=.device; [[ $build == old ]] && dir=.device-old
        replay "$setting-chunk$chunk-$run-$build-$round" $dir --chunk-mib "$chunk" "${extra[@]}"
      done
    done
  done
}

echo "== each process its own context"
matrix contexts 1:device-serial 1:device-task-graph 8:device-serial 8:device-task-graph 8:ipc-serial 8:ipc-task-graph
echo "== MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if nvidia-cuda-mps-control -d; then
  matrix mps 1:device-serial 1:device-task-graph 8:device-serial 8:device-task-graph
  echo quit | nvidia-cuda-mps-control
  sleep 2
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

echo "== the new build's CUDA tests"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu
for t in test_cuda:60 test_nccl:60 test_cuda_sync:200; do
  name=${t%%:*}
  timeout "${t##*:}" .device/$name --no-version -d >"$out/$name.log" 2>&1
  echo "exit $?" >>"$out/$name.log"
  echo "$name: $(grep -E '^\[doctest\] test cases' "$out/$name.log") $(tail -1 "$out/$name.log")"
done
tar -czf "$OUT/precise-timers-h100.tar.gz" -C "$OUT" precise-timers-h100 && rm -rf "$out"
