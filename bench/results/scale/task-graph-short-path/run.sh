#!/usr/bin/env bash
# The task graph's short path at many ranks on one machine over TCP loopback: allreduce of 4 KiB,
# 64 KiB and 1 MiB with topology::Auto, side by side in alternating rounds:
#   task-graph       this checkout's default executor
#   serial           this checkout's serial walk (--executor serial)
#   before-serial    the serial walk of the commit before the short path (its build in BEFORE)
#   before-task-graph  ... and its task graph
#   openmpi          MPI_Allreduce of the same values through bench/allreduce --collective
#                    mpi-allreduce (Open MPI over TCP only, yielding when idle)
# Each run's JSON goes to this folder; summarize.py writes summary.json and prints the medians.
# Usage, from the repository root after `meson setup build-release -Dbuildtype=release` and a build
# of the earlier commit (git worktree add ../before fea897e; meson setup ../before/build ...):
#   bench/results/scale/task-graph-short-path/run.sh BEFORE_BUILD [ROUNDS] [RANKS...]
set -u
before=${1:?usage: run.sh BEFORE_BUILD [ROUNDS] [RANKS...]}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
ranks=("$@")
[[ ${#ranks[@]} -gt 0 ]] || ranks=(64 256)
here=$(dirname "$0")
ulimit -n 20000 2>/dev/null || true
sizes=(--min-bytes 4K --max-bytes 1M --step-factor 16 --iters 10 --warmup 2)
gradsync() {  # NAME BUILD N [ARGS...]
  local name=$1 build=$2 n=$3
  shift 3
  echo "== $name, $n ranks, round $round"
  timeout 900 tools/gradsync-run -n "$n" "$build/bench/allreduce" --transport tcp --local-transport tcp \
    --topology auto "${sizes[@]}" --json "$here/$name-$n-$round.json" "$@" 2>&1 | grep -E "^\[0\]  |rror"
}
for n in "${ranks[@]}"; do
  for round in $(seq 1 "$rounds"); do
    gradsync task-graph build-release "$n"
    gradsync before-serial "$before" "$n" --executor serial
    gradsync serial build-release "$n" --executor serial
    gradsync before-task-graph "$before" "$n"
    echo "== openmpi, $n ranks, round $round"
    timeout 900 mpirun --allow-run-as-root --oversubscribe -n "$n" --mca btl self,tcp --mca mpi_yield_when_idle 1 \
      build-release/bench/allreduce --transport mpi --collective mpi-allreduce "${sizes[@]}" \
      --json "$here/openmpi-$n-$round.json" 2>&1 | grep -E "^  "
  done
done
python3 "$here/summarize.py"
