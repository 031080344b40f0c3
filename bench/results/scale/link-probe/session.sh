#!/usr/bin/env bash
# topology::Auto's link probe on 16 emulated hosts x 8 ranks at 1 Gbit/s (netcluster), in one run:
# Auto with the probe round the ring (each rank sends right and receives left, as
# engine::calibrate_link does, built from 67290bf) against Auto with an experiment not kept: an
# exchange with the rank half the group away (both send, both receive; one untimed, then five at
# each of 4 KiB, 64 KiB and 2 MiB, as measure_transfer times them), built from 67290bf with that
# change to engine/cost_model.hpp as build/bench/allreduce; recursive doubling and halving-doubling alone, to show which choice
# was the fast one; Open MPI's MPI_Allreduce (tuned) at 4 KiB, 64 KiB and 1 MiB. Serial executor,
# all TCP, slowest rank's median of 10 after 2 warm-ups.
# Usage (root, from the repository root): bench/results/scale/link-probe/session.sh OUT RING_PROBE_BINARY
#   RING_PROBE_BINARY: bench/allreduce built from 67290bf, copied beside build/bench/allreduce
#   (this checkout's) so that it finds the same libgradsync.
set -u
out=$1 ring_probe=$2
mkdir -p "$out"
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
OMPI=/work/shared/tools/openmpi
$NC up 16 1gbit >/dev/null
run() {  # NAME BINARY TOPOLOGY
  echo "== gradsync $1 ($3), serial executor, 16 hosts x 8 ranks"
  RANKS_PER_HOST=8 $NC run 16 "$2" --transport tcp --local-transport tcp --topology "$3" \
    --executor serial --min-bytes 4K --max-bytes 4M --step-factor 4 --iters 10 --warmup 2 \
    --json "$out/gradsync-$1-16x8.json" 2>&1 | grep -E "^\[0\] ( |# link|# ranks)"
}
run auto-ring-probe "$ring_probe" auto
run auto-exchange-probe build/bench/allreduce auto
run recursive-doubling build/bench/allreduce recursive-doubling
run halving-doubling build/bench/allreduce halving-doubling
exe=/tmp/openmpi-allreduce-small
[ "$exe" -nt "$OMPI/allreduce_small.c" ] || mpicc -O2 "$OMPI/allreduce_small.c" -o "$exe"
hosts=$(for ((i = 0; i < 16; i++)); do printf 'gs%d:8,' "$i"; done)
echo "== Open MPI (tuned), 16 hosts x 8 ranks"
ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec mpirun --allow-run-as-root -n 128 --host ${hosts%,} \
  --mca plm_rsh_agent $OMPI/nsrsh --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $exe 10" 2>&1 | grep "^openmpi" | tee "$out/openmpi-tuned-16x8.txt"
