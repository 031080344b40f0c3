#!/usr/bin/env bash
# An example timeline to open in Perfetto (ui.perfetto.dev) or chrome://tracing: fmnist on 4
# emulated hosts at 1 Gbit/s, 30 steps of 64 samples a rank, defaults otherwise (ring, fixed-size
# buckets, task graph), with and without ef-two-bit; merge.py joins each run's four files into
# one trace. Usage: session.sh OUT_DIR
set -u
out=$(realpath -m "$1"); mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
for codec in none ef-two-bit; do
  echo "== $codec"
  GRADSYNC_TIMELINE="$out/$codec.json" $NC run 4 ./build-release/examples/fmnist --batch 64 --steps 30 --codec $codec 2>&1 | grep "done:"
done
python3 examples/fmnist/results/timeline/merge.py "$out"
