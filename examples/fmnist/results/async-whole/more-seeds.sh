#!/usr/bin/env bash
# A second round after session.sh: seeds 11-20 of the synchronous server, s=2 M=3 with the epoch's
# catch-up and without (NO_CATCH_UP_FMNIST, as in session.sh), interleaved seed by seed, batch 128.
# Usage: more-seeds.sh OUT_DIR NO_CATCH_UP_FMNIST
set -u
out=$(realpath -m "$1") nocatchup=$(realpath "$2"); mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
new=./build-release/examples/fmnist
run() { local name=$1 bin=$2; shift 2; echo "== $name: $*"
        $NC run 4 $bin --topology parameter-server --slow-rank 3 --slow-factor 2 "$@" --json "$out/$name.json" 2>&1 | grep "done:"; }
for seed in $(seq 11 20); do
  run b128-sync-seed$seed $new --batch 128 --seed $seed
  run b128-s2-m3-seed$seed $new --batch 128 --seed $seed --staleness 2 --quorum 3
  run b128-s2-m3-no-catch-up-seed$seed $nocatchup --batch 128 --seed $seed --staleness 2 --quorum 3
done
