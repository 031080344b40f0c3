#!/usr/bin/env bash
# The compressed allreduce of 64 MiB on 4 emulated hosts at 1 Gbit/s, on gradient-like data
# (bench/allreduce's default --data gradient: N(0, 0.01), different on every rank), every codec
# in turn, three rounds; each run writes its own JSON here. summarize.py makes the table.
#   bash bench/results/codecs-gradient/session.sh   (from the repository root, netcluster up 4 1gbit)
set -euo pipefail
out=$(realpath "$(dirname "$0")")
export GRADSYNC_TOKEN=${GRADSYNC_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')} GRADSYNC_TCP_CONGESTION=cubic
export LD_LIBRARY_PATH=$PWD/build-release
netcluster=${NETCLUSTER:-../shared/tools/netcluster}
for round in 1 2 3; do
  for codec in none ef-two-bit ef-one-bit terngrad ef-top-k ef-random-k; do
    keep=()
    [[ $codec == ef-top-k || $codec == ef-random-k ]] && keep=(--keep 0.01)
    "$netcluster" run 4 ./build-release/bench/allreduce --transport tcp --executor serial --min-bytes 64M --max-bytes 64M --iters 10 \
      --codec "$codec" "${keep[@]}" --json "$out/$codec-$round.json" 2>&1 | grep -E "^\[0\] +[0-9]|ranks differing"
  done
done
