#!/usr/bin/env bash
# fmnist alone (one rank, batch 64, one epoch) with the MLP's products on Eigen (this build)
# against the hand-written loops of the build before, alternating, ROUNDS rounds.
# Usage: session.sh OUT_DIR OLD_FMNIST [ROUNDS]   (OLD_FMNIST: a copy of the earlier binary,
# with its libgradsync beside it)
set -u
out=$1 old=$2 rounds=${3:-3}
mkdir -p "$out"
cd "$(dirname "$0")/../../../.."
new=./build-release/examples/fmnist
for r in $(seq 1 "$rounds"); do
  echo "== eigen-$r"; $new --batch 64 --json "$out/eigen-$r.json" | grep "done:"
  echo "== loops-$r"; LD_LIBRARY_PATH=$(dirname "$old") $old --batch 64 --json "$out/loops-$r.json" | grep "done:"
done
