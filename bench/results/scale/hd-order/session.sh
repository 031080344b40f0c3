#!/usr/bin/env bash
# Halving-doubling's round order on 16 emulated hosts x 8 ranks at 1 Gbit/s (netcluster), in one
# run: partners far-first (the order before 2026-11-28: the first reduce-scatter round sends half
# the bucket across machines from all 8 ranks of each) against near-first (halving_doubling.hpp
# now), then topology::Auto, which takes halving-doubling for the middle sizes, and Open MPI's
# MPI_Allreduce (tuned) at the same sizes. Serial executor, all TCP (--local-transport tcp),
# slowest rank's median of 10 after 2 warm-ups.
# Usage (root, from the repository root): bench/results/scale/hd-order/session.sh FAR_FIRST_BINARY
#   FAR_FIRST_BINARY: bench/allreduce built from commit c503e9a (far-first), copied beside
#   build/bench/allreduce (this checkout's) so that it finds the same libgradsync.
set -u
far_first=$1
out=$(dirname "$0")
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
OMPI=/work/shared/tools/openmpi
$NC up 16 1gbit >/dev/null
run() {  # NAME BINARY TOPOLOGY
  echo "== gradsync $1 ($3), serial executor, 16 hosts x 8 ranks"
  RANKS_PER_HOST=8 $NC run 16 "$2" --transport tcp --local-transport tcp --topology "$3" \
    --executor serial --min-bytes 64K --max-bytes 4M --step-factor 4 --iters 10 --warmup 2 \
    --json "$out/gradsync-$1-16x8.json" 2>&1 | grep -E "^\[0\] ( |# link|# ranks)"
}
run hd-far-first "$far_first" halving-doubling
run hd-near-first build/bench/allreduce halving-doubling
run auto build/bench/allreduce auto
exe=/tmp/openmpi-allreduce-small
[ "$exe" -nt "$OMPI/allreduce_small.c" ] || mpicc -O2 "$OMPI/allreduce_small.c" -o "$exe"
hosts=$(for ((i = 0; i < 16; i++)); do printf 'gs%d:8,' "$i"; done)
echo "== Open MPI (tuned), 16 hosts x 8 ranks"
ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec mpirun --allow-run-as-root -n 128 --host ${hosts%,} \
  --mca plm_rsh_agent $OMPI/nsrsh --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $exe 10" 2>&1 | grep "^openmpi" | tee "$out/openmpi-tuned-16x8.txt"
