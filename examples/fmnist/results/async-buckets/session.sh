#!/usr/bin/env bash
# The asynchronous parameter server with a bucketing policy (2026-11-29): 4 emulated hosts at
# 1 Gbit/s, seed 1, one epoch. Run from this directory with the build's examples on PATH and
# GRADSYNC_TOKEN set.
#   equal-*.json: staleness 0, quorum 4, period 1 against the synchronous parameter server, with
#                 fixed-size and time-clustered buckets on both sides: the same digits expected.
#   speed-*.json: staleness 0 and 2, quorum 4, no period averaging, each bucketing policy three
#                 times, alternating, for samples per second side by side.
set -euo pipefail
netcluster up 4 1gbit
for b in fixed-size time-clustered; do
  netcluster run 4 fmnist --topology parameter-server --bucketing $b --seed 1 --epochs 1 --json equal-sync-$b.json
  netcluster run 4 fmnist --topology parameter-server --bucketing $b --seed 1 --epochs 1 --staleness 0 --period 1 \
    --json equal-async-$b.json
done
for run in 1 2 3; do
  for s in 0 2; do
    for b in fixed-size per-tensor time-clustered; do
      netcluster run 4 fmnist --topology parameter-server --bucketing $b --seed 1 --epochs 1 --staleness $s \
        --json speed-s$s-$b-$run.json
    done
  done
done
