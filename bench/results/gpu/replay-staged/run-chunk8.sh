#!/usr/bin/env bash
# (As run: from .gpu/ at the repository root, with replay and its libraries in .gpu/ and .gpu/lib.)
# Session 2026-11-26b, device call after the last: bench/replay with 8 MiB pieces on ResNet-50's gradients (full size, all
# ready at once), 4 ranks sharing the one GPU (gradsync-run: shared memory between them),
# ef-two-bit: codecs on the host (serial and task graph) against codecs on the GPU (--device,
# transport::CudaStaged, serial), two rounds in turn.
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
nproc | tee -a $OUT/gpu.txt
common="--trace bench/traces/resnet50.trace --codec ef-two-bit --bucketing fixed-size --time-scale 0 --size-scale 1 --iters 10 --warmup 3 --chunk-mib 8"
for round in 1 2; do
  for config in host-serial device-serial; do
    case $config in
      host-serial) extra="--executor serial";;
      host-task-graph) extra="--executor task-graph";;
      device-serial) extra="--executor serial --device";;
    esac
    echo "== $config $round" | tee -a $OUT/replay.log
    timeout 60 python3 tools/gradsync-run -n 4 .gpu/replay $common $extra --json $OUT/replay-chunk8-$config-$round.json 2>&1 | grep -v "^\[[123]\]" | tee -a $OUT/replay.log | tail -4
  done
done
