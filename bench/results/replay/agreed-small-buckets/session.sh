#!/usr/bin/env bash
# Ran on 2026-11-28 with build/ at 970ae44 (branch agreed-small-buckets, not merged: bench/README.md, "many ranks").
# Replayed training steps with the task graph's small buckets walked by a thread of the graph's own
# (Options::serial_bucket_bytes, 64 KiB by default) against every bucket through the graph
# (--serial-bucket-bytes 0), alternating, on 4 emulated hosts at 1 Gbit/s (netcluster): ResNet-50
# and BERT-base with per-tensor and time-clustered bucketing, ROUNDS rounds; each run's JSON and
# whole output in OUT.
# Usage: session.sh OUT [ROUNDS]   (root; from the repository root, after a build in build/)
set -u
out=$1 rounds=${2:-2}
mkdir -p "$out"
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
$NC up 4 1gbit >/dev/null
for ((round = 1; round <= rounds; ++round)); do
  for trace in resnet50 bert-base; do
    for policy in per-tensor time-clustered; do
      for serial in 0 65536; do
        name=$trace-$policy-serial-$serial-$round
        echo "== $name"
        $NC run 4 build/bench/replay --trace bench/traces/$trace.trace --bucketing $policy --iters 15 --warmup 8 \
          --serial-bucket-bytes $serial --json "$out/$name.json" 2>&1 | tee "$out/$name.log" | grep -E "^\[0\] [^#]|iteration"
      done
    done
  done
done
