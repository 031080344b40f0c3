#!/usr/bin/env bash
# The two stand-ins side by side, rounds interleaved: sync, share, whole (4 emulated hosts at
# 1 Gbit/s, rank 3 2x slower, staleness 2, quorum 3). Usage: stand-in.sh OUT_DIR
set -u
out=$1; mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
run() { local name=$1; shift; echo "== $name: $*"; $NC run 4 ./build-release/examples/fmnist --topology parameter-server --slow-rank 3 --slow-factor 2 "$@" --json "$out/$name.json" 2>&1 | grep "done:"; }
for b in 128 16; do
  rounds=3; [ $b = 16 ] && rounds=2
  for r in $(seq 1 $rounds); do
    [ $r -le 2 ] && run b$b-sync-$r --batch $b
    run b$b-share-$r --batch $b --staleness 2 --quorum 3 --stand-in share
    run b$b-whole-$r --batch $b --staleness 2 --quorum 3 --stand-in whole
  done
done
