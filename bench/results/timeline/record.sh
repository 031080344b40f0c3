#!/usr/bin/env bash
# bench/timeline: the cost of one record() with 1, 2 and 4 threads recording at once (this machine
# has 2 cores), and of writing the trace. Usage: record.sh OUT_DIR
set -u
out=$(realpath -m "$1"); mkdir -p "$out"
cd /work/main
for t in 1 2 4; do build-release/bench/timeline --threads $t --events 200000 --json "$out/record-$t-threads.json"; done
