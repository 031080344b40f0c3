#!/usr/bin/env bash
# A small send to an idle Tcp socket written from the caller's thread (send_now) against the build
# before (every send handed to the io thread), side by side, alternating, at N ranks on loopback:
# bench/allreduce --topology auto, serial executor and task graph, 4 KiB .. 1 MiB.
# Usage: send-now.sh OUT_DIR N OLD_LIB_DIR NEW_LIB_DIR [ROUNDS] [EXECUTORS]   (libgradsync.so of each
# build; EXECUTORS defaults to "serial task-graph")
set -u
out=$1 n=$2 old=$3 new=$4 rounds=${5:-2} executors=${6:-serial task-graph}
mkdir -p "$out"
ulimit -n 20000
for round in $(seq "$rounds"); do
  for build in old new; do
    lib=$old; [[ $build == new ]] && lib=$new
    for executor in $executors; do
      echo "== $build build, round $round, $executor, $n ranks"
      LD_LIBRARY_PATH=$lib tools/gradsync-run -n "$n" build/bench/allreduce --transport tcp --local-transport tcp \
        --topology auto --executor "$executor" --min-bytes 4K --max-bytes 1M --step-factor 16 --iters 10 --warmup 2 \
        --json "$out/$build-$executor-$n-round$round.json" 2>&1 | grep -E "^\[0\] ( |# ranks)"
    done
  done
done
