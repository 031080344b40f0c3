#!/usr/bin/env bash
# The fifth document's sparse tables composed with the first's time-clustered buckets, ef-two-bit
# and a hierarchical allreduce for the MLP, against ctr's default dense path (fixed-size buckets,
# no codec, one ring): 2 emulated hosts x 2 trainers at 1 Gbit/s, one epoch, seed 1; then the
# composed job over ef-two-bit thresholds. Run from this directory with build/examples on PATH and
# GRADSYNC_TOKEN set.
set -euo pipefail
netcluster up 2 1gbit
run() { RANKS_PER_HOST=2 netcluster run 2 ctr --epochs 1 "$@"; }
run --json default.json
run --bucketing time-clustered --topology hierarchical --json time-clustered-hierarchical.json
run --bucketing time-clustered --codec ef-two-bit --topology hierarchical --json composed.json
for t in 0.5 0.2 0.05 0.02 0.005; do
  run --bucketing time-clustered --codec ef-two-bit --topology hierarchical --threshold $t --json composed-threshold-$t.json
done
