#!/usr/bin/env bash
# libtorch-fmnist (gradsync: uncompressed and ef-two-bit) beside PyTorch's DistributedDataParallel
# (gloo; and its fp16 compression hook) on 4 emulated hosts at 1 Gbit/s (netcluster up 4 1gbit),
# the same model, data, batch (32 a rank), learning rate and momentum, one LibTorch thread a rank,
# one epoch; ROUNDS rounds, the four runs of a round one after the other.
# Usage: session.sh OUT_DIR ROUNDS   (from the repository root, release build in build-release)
set -u
out=$(realpath -m "$1") rounds=$2; mkdir -p "$out"
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
run() { local name=$1; shift; echo "== $name: $*"; $NC run 4 "$@" --json "$out/$name.json" 2>&1 | grep -E "done:|ms a step"; }
for round in $(seq 1 "$rounds"); do
  run gradsync-none-$round build-release/examples/libtorch-fmnist --codec none
  run gradsync-ef-two-bit-$round build-release/examples/libtorch-fmnist --codec ef-two-bit
  run ddp-$round /usr/bin/python3 examples/libtorch/ddp.py
  run ddp-fp16-$round /usr/bin/python3 examples/libtorch/ddp.py --hook fp16
done
