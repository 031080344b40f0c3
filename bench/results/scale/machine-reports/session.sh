#!/usr/bin/env bash
# Setup with each machine's ranks reporting to rank 0 together (TcpOptions::local_rank/local_size)
# against the build before (every rank reports to rank 0 itself), side by side, alternating, on
# this machine over TCP loopback (gradsync-run: one machine, LOCAL_WORLD_SIZE = N), then on 16
# emulated hosts x 8 ranks (netcluster, 1 Gbit/s). bench/setup, 3 rounds each, slowest rank.
# Usage: session.sh OUT_DIR BEFORE_SETUP AFTER_SETUP [ROUNDS_OF_RUNS] [N...]
#   (BEFORE_SETUP / AFTER_SETUP: bench/setup of each build, each beside its own libgradsync.so)
set -u
out=$1 before=$2 after=$3 repeats=${4:-2}
shift $(( $# >= 4 ? 4 : 3 ))
sizes=("$@")
[[ ${#sizes[@]} -gt 0 ]] || sizes=(64 128 256 512)
mkdir -p "$out"
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p)
NC=/work/shared/tools/netcluster
for round in $(seq "$repeats"); do
  for n in "${sizes[@]}"; do
    for build in before after; do
      exe=$before; [[ $build == after ]] && exe=$after
      echo "== $build, round $round, $n ranks on loopback"
      tools/gradsync-run -n "$n" "$exe" --rounds 3 --json "$out/$build-loopback-$n-round$round.json" 2>&1 |
        grep -E "^\[0\] (median)"
    done
  done
done
$NC up 16 1gbit >/dev/null
for round in $(seq "$repeats"); do
  for build in before after; do
    exe=$before; [[ $build == after ]] && exe=$after
    echo "== $build, round $round, 16 hosts x 8 ranks"
    RANKS_PER_HOST=8 $NC run 16 "$exe" --rounds 3 --json "$out/$build-hosts-16x8-round$round.json" 2>&1 |
      grep -E "^\[0\] (median)"
  done
done
