#!/usr/bin/env bash
# How libtorch-fmnist's two-bit threshold was chosen: one epoch of ef-two-bit on 4 emulated hosts at
# 1 Gbit/s per threshold, with the build before the default became 0.01. 0.1, then the default,
# ran in a first round of session.sh (which also sets GRADSYNC_TCP_CONGESTION=cubic); 0.01, 0.03
# and 0.005 ran as below. Usage: thresholds.sh OUT_DIR   (from the repository root)
set -u
out=$(realpath -m "$1"); mkdir -p "$out"
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p)
for t in 0.01 0.03 0.005; do
  /work/shared/tools/netcluster run 4 build-release/examples/libtorch-fmnist --codec ef-two-bit --threshold $t \
    --json "$out/ef-two-bit-threshold-$t.json" 2>&1 | grep "done:"
done
