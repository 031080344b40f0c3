#!/usr/bin/env bash
# Allreduce of 4 KiB, 64 KiB and 1 MiB at N ranks on this machine over TCP loopback: gradsync's ring
# (task graph), topology::Auto (serial executor and task graph), and Open MPI's MPI_Allreduce
# (tools/openmpi/small: TCP only, yielding when idle) in the same run. Slowest rank's median.
# Usage: run.sh OUT_DIR N [ITERS] [TOPOLOGIES...]   (from the repository root, after a build in build/)
set -u
out=$1 n=$2 iters=${3:-10}
shift $(( $# >= 3 ? 3 : 2 ))
runs=("$@")
[[ ${#runs[@]} -gt 0 ]] || runs=(ring:task-graph auto:serial auto:task-graph)
mkdir -p "$out"
ulimit -n 20000
for run in "${runs[@]}"; do
  topology=${run%%:*} executor=${run##*:}
  echo "== gradsync $topology, $executor executor, $n ranks"
  tools/gradsync-run -n "$n" build/bench/allreduce --transport tcp --local-transport tcp --topology "$topology" \
    --executor "$executor" --min-bytes 4K --max-bytes 1M --step-factor 16 --iters "$iters" --warmup 2 \
    --json "$out/gradsync-$topology-$executor-$n.json" 2>&1 | grep -E "^\[0\] ( |# link|# ranks)"
done
echo "== Open MPI, $n ranks"
/work/shared/tools/openmpi/small "$n" "$iters" 2>&1 | tee "$out/openmpi-$n.txt"
