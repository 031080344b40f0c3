#!/usr/bin/env bash
# Ran on 2026-11-28 with build/ at 970ae44 (branch agreed-small-buckets, not merged: bench/README.md, "many ranks").
# The task graph with small buckets walked by a thread of the graph's own (Options::serial_bucket_bytes, 64 KiB
# by default) against every bucket through the graph (--serial-bucket-bytes 0) and the serial
# executor, alternating, then Open MPI, in one session: N ranks on TCP loopback, Auto, 4 KiB /
# 64 KiB / 1 MiB, slowest rank's median of ITERS; each run's whole output beside its JSON.
# Usage: session.sh OUT [ROUNDS] [ITERS] [N]   (from the repository root, after a build in build/)
set -u
out=$1 rounds=${2:-2} iters=${3:-10} n=${4:-64}
mkdir -p "$out"
ulimit -n 20000
run() {  # run NAME ALLREDUCE-OPTIONS...
  local name=$1
  shift
  echo "== $name, $n ranks"
  tools/gradsync-run -n "$n" build/bench/allreduce --transport tcp --local-transport tcp --topology auto "$@" \
    --min-bytes 4K --max-bytes 1M --step-factor 16 --iters "$iters" --warmup 2 --json "$out/$name.json" 2>&1 |
    tee "$out/$name.log" | grep -E "^\[0\] ( |# link)"
}
for ((round = 1; round <= rounds; ++round)); do
  run "graph-all-$round-$n" --executor task-graph --serial-bucket-bytes 0
  run "graph-small-here-$round-$n" --executor task-graph
  run "serial-$round-$n" --executor serial
  echo "== Open MPI, $n ranks"
  /work/shared/tools/openmpi/small "$n" "$iters" 2>&1 | tee "$out/openmpi-$round-$n.txt"
done
