#!/usr/bin/env bash
# fmnist's asynchronous parameter server beside the synchronous one on 4 emulated hosts at 1 Gbit/s,
# one rank 2x slower: this build, and the build before (every global gradient once vs the newest
# only), one run after the other. Usage: session.sh OUT_DIR OLD_FMNIST
set -u
out=$1 old=$2; mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
run() { local name=$1 bin=$2; shift 2; echo "== $name: $*"; $NC run 4 $bin --topology parameter-server --slow-rank 3 --slow-factor 2 "$@" --json "$out/$name.json" 2>&1 | grep "done:"; }
new=./build-release/examples/fmnist
for b in 16 128; do
  for r in 1 2; do
    run b$b-sync-$r $new --batch $b
    run b$b-s2-m3-$r $new --batch $b --staleness 2 --quorum 3
    run b$b-s2-m3-newest-only-$r $old --batch $b --staleness 2 --quorum 3
  done
  for s in 0 1 2 4; do for m in 2 3 4; do run b$b-s$s-m$m $new --batch $b --staleness $s --quorum $m; done; done
  run b$b-s2-m3-k20 $new --batch $b --staleness 2 --quorum 3 --period 20
done
