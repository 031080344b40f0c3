#!/usr/bin/env bash
# fmnist's asynchronous parameter server beside the synchronous one on 4 emulated hosts at 1 Gbit/s,
# one rank 2x slower, over several seeds (one epoch's test accuracy moves by 2-4 points with the
# seed and with the step it stops at, so single runs cannot tell 1 point apart). The stand-in of
# this build (the whole local gradient) and the build before (l_t / M), interleaved seed by seed;
# and this build without the epoch's last wait(0) (NO_CATCH_UP_FMNIST, built from this tree
# before that change).
# Usage: session.sh OUT_DIR OLD_FMNIST NO_CATCH_UP_FMNIST   (copies of build-release/examples/fmnist;
# the caller sets LD_LIBRARY_PATH for them: libgradsync did not change)
set -u
out=$(realpath -m "$1") old=$(realpath "$2") nocatchup=$(realpath "$3"); mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
new=./build-release/examples/fmnist
run() { local name=$1 bin=$2; shift 2; echo "== $name: $*"
        $NC run 4 $bin --topology parameter-server --slow-rank 3 --slow-factor 2 "$@" --json "$out/$name.json" 2>&1 | grep "done:"; }
for seed in 1 2 3 4 5 6 7 8 9 10; do
  run b128-sync-seed$seed $new --batch 128 --seed $seed
  run b128-s2-m3-seed$seed $new --batch 128 --seed $seed --staleness 2 --quorum 3
  run b128-s2-m3-share-seed$seed $old --batch 128 --seed $seed --staleness 2 --quorum 3
done
for seed in 1 2 3 4 5; do
  run b16-sync-seed$seed $new --batch 16 --seed $seed
  run b16-s2-m3-seed$seed $new --batch 16 --seed $seed --staleness 2 --quorum 3
done
for seed in 1 2 3 4 5; do
  run b128-s2-m3-no-catch-up-seed$seed $nocatchup --batch 128 --seed $seed --staleness 2 --quorum 3
  run b128-s4-m3-no-catch-up-seed$seed $nocatchup --batch 128 --seed $seed --staleness 4 --quorum 3
done
for seed in 1 2 3 4 5; do
  for s in 0 1 2 4; do for m in 2 3 4; do
    [ $s = 2 ] && [ $m = 3 ] && continue  # above, ten seeds
    run b128-s$s-m$m-seed$seed $new --batch 128 --seed $seed --staleness $s --quorum $m
  done; done
done
