#!/usr/bin/env bash
# The hybrid trainer on 4 emulated hosts at 1 Gbit/s (2 conv + 2 fc ranks) beside 4-rank data
# parallelism of the same model and global batch, each with background updates and with updates
# after wait(): one epoch per run, the four runs of a round one after the other, ROUNDS rounds.
# Usage: session.sh OUT_DIR [ROUNDS]   (from a build in build-release; summarize.py reads OUT_DIR)
set -u
out=$1 rounds=${2:-3}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
$NC up 4 1gbit >/dev/null
bin=./build-release/examples/hybrid
for r in $(seq 1 "$rounds"); do
  for mode in hybrid data-parallel; do
    for updates in background after-wait; do
      name=$mode-$updates-$r
      echo "== $name"
      $NC run 4 $bin --mode "$mode" --updates "$updates" --epochs 1 --json "$out/$name.json" 2>&1 | grep -E "epoch 1:|rror"
    done
  done
done
