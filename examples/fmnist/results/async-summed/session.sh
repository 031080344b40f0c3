#!/usr/bin/env bash
# fmnist's asynchronous parameter server (s=2, M=3) beside the synchronous one on 4 emulated hosts
# at 1 Gbit/s, one rank 2x slower, batch 128, one epoch, seeds interleaved: this build (a worker
# behind the others pulls once an iteration and gets the global gradients it missed summed in one
# reply) and the build before (OLD_FMNIST: every global gradient its own reply).
# Usage: [TABLE_SEEDS=N] session.sh OUT_DIR OLD_FMNIST SEEDS   (OLD_FMNIST: a copy of build-release/examples/fmnist;
# the caller sets LD_LIBRARY_PATH for it: libgradsync did not change)
set -u
out=$(realpath -m "$1") old=$(realpath "$2") seeds=$3; mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
new=./build-release/examples/fmnist
run() { local name=$1 bin=$2; shift 2; echo "== $name: $*"
        $NC run 4 $bin --topology parameter-server --slow-rank 3 --slow-factor 2 "$@" --json "$out/$name.json" 2>&1 | grep "done:"; }
for seed in $(seq 1 "$seeds"); do
  run b128-sync-seed$seed $new --batch 128 --seed $seed
  run b128-s2-m3-seed$seed $new --batch 128 --seed $seed --staleness 2 --quorum 3
  run b128-s2-m3-before-seed$seed $old --batch 128 --seed $seed --staleness 2 --quorum 3
done
# The table over staleness and quorum, this build (s=2, M=3 above).
[ "${TABLE_SEEDS:-0}" -gt 0 ] && for seed in $(seq 1 "$TABLE_SEEDS"); do
  for s in 0 1 2 4; do for m in 2 3 4; do
    [ $s = 2 ] && [ $m = 3 ] && continue
    run b128-s$s-m$m-seed$seed $new --batch 128 --seed $seed --staleness $s --quorum $m
  done; done
done
