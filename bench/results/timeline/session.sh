#!/usr/bin/env bash
# What the timeline costs a synchronization: bench/replay with every gradient ready at once
# (--time-scale 0: an iteration is one synchronization), 4 ranks on this machine over TCP, with
# GRADSYNC_TIMELINE set and not, alternately, three rounds. ResNet-50's 161 tensors, one bucket
# each (per-tensor: the most events a step), at 1% and at full size. Also keeps one round's trace
# files, to count the events a synchronization records. Usage: session.sh OUT_DIR
set -u
out=$(realpath -m "$1"); mkdir -p "$out"
cd /work/main
export GRADSYNC_TCP_CONGESTION=cubic
replay() { tools/gradsync-run -n 4 build-release/bench/replay --trace bench/traces/resnet50.trace --time-scale 0 \
             --bucketing per-tensor --iters 50 --warmup 10 "$@"; }
for round in 1 2 3; do
  for scale in 0.01 1; do
    echo "== round $round, size scale $scale, no timeline"
    replay --size-scale $scale --json "$out/off-$scale-$round.json" | tail -3
    echo "== round $round, size scale $scale, timeline"
    rm -rf "$out/trace-$scale"; mkdir -p "$out/trace-$scale"
    GRADSYNC_TIMELINE="$out/trace-$scale/trace.json" replay --size-scale $scale --json "$out/on-$scale-$round.json" | tail -3
  done
done
