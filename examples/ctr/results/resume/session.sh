#!/usr/bin/env bash
# A checkpoint and a resume against an unbroken run: 2 emulated hosts x 2 trainers at 1 Gbit/s,
# seed 1. Two epochs at once (unbroken.json); one epoch writing a checkpoint (first.json), then
# the second epoch resumed from it (resumed.json). Run from this directory with build/examples on
# PATH and GRADSYNC_TOKEN set.
set -euo pipefail
netcluster up 2 1gbit
run() { RANKS_PER_HOST=2 netcluster run 2 ctr "$@"; }
rm -rf checkpoint
run --epochs 2 --json unbroken.json
run --epochs 1 --checkpoint checkpoint --json first.json
run --epochs 2 --resume checkpoint --json resumed.json
ls -l checkpoint > checkpoint.ls
rm -rf checkpoint
