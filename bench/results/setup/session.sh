#!/usr/bin/env bash
# bench/setup on 4 emulated hosts at 1 Gbit/s, without and with bench/flood.py flooding rank 0's
# port from a fifth host (200 connections held open, half silent, half sending garbage, each
# replaced when the job closes it): this build, and the build before for comparison.
# Usage: session.sh OUT_DIR OLD_SETUP_DIR [ROUNDS]   (OLD_SETUP_DIR: an earlier build's bench/setup
# with its libgradsync beside it, or "" for none)
set -u
out=$1 old=${2:-} rounds=${3:-20}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic GRADSYNC_SETUP_TIMEOUT_S=30
NC=/work/shared/tools/netcluster
$NC up 5 1gbit >/dev/null
run() {  # run NAME BINARY_DIR
  local name=$1 dir=$2
  echo "== $name"
  LD_LIBRARY_PATH=$dir $NC run 4 "$dir/setup" --rounds "$rounds" --json "$out/$name.json" 2>&1 | grep -E "median|setup: "
}
flood() {  # flood NAME BINARY_DIR
  $NC exec 4 python3 bench/flood.py 10.77.0.1 29400 200 >"$out/$1-flood.log" 2>&1 &
  local flooder=$!
  sleep 2
  run "$@"
  kill $flooder; wait $flooder 2>/dev/null
  tail -1 "$out/$1-flood.log"
}
new=./build-release/bench
run quiet "$new"
flood flooded "$new"
if [[ -n $old ]]; then
  run before-quiet "$old"
  flood before-flooded "$old"
fi
