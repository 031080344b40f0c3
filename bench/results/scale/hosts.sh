#!/usr/bin/env bash
# 16 emulated hosts x 8 ranks at 1 Gbit/s (netcluster): gradsync's allreduce of 4 KiB, 64 KiB and
# 1 MiB by topology (all TCP: --local-transport tcp), beside Open MPI's MPI_Allreduce at the same
# sizes, tuned and HAN (shared memory within a host, TCP across), in one run.
# Usage: hosts.sh OUT_DIR [ITERS] [TOPOLOGIES...]   (root; from the repository root, after a build in build/)
# A topology may carry bench/allreduce options after commas: hierarchical,--across,ring.
# MAX_BYTES (default 1M) raises the largest size; OPENMPI=no leaves Open MPI out (it stops at 1 MiB).
set -u
out=$1 iters=${2:-10}
shift $(( $# >= 2 ? 2 : 1 ))
topologies=("$@")
[[ ${#topologies[@]} -gt 0 ]] || topologies=(auto ring hierarchical)
mkdir -p "$out"
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
OMPI=/work/shared/tools/openmpi
$NC up 16 1gbit >/dev/null
for spec in "${topologies[@]}"; do
  IFS=, read -r -a words <<< "$spec"
  name=${spec//,--/-}; name=${name//,/-}  # hierarchical-across-ring
  echo "== gradsync ${words[*]}, serial executor, 16 hosts x 8 ranks"
  RANKS_PER_HOST=8 $NC run 16 build/bench/allreduce --transport tcp --local-transport tcp --topology "${words[@]}" \
    --executor serial --min-bytes 4K --max-bytes "${MAX_BYTES:-1M}" --step-factor 16 --iters "$iters" --warmup 2 \
    --json "$out/gradsync-$name-16x8.json" 2>&1 | grep -E "^\[0\] ( |# link|# ranks)"
done
[[ ${OPENMPI:-yes} == no ]] && exit 0
exe=/tmp/openmpi-allreduce-small
[ "$exe" -nt "$OMPI/allreduce_small.c" ] || mpicc -O2 "$OMPI/allreduce_small.c" -o "$exe"
hosts=$(for ((i = 0; i < 16; i++)); do printf 'gs%d:8,' "$i"; done)
for variant in tuned han; do
  extra=""; [[ $variant == han ]] && extra="--mca coll_han_priority 100"
  echo "== Open MPI ($variant), 16 hosts x 8 ranks"
  ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec mpirun --allow-run-as-root -n 128 --host ${hosts%,} \
    --mca plm_rsh_agent $OMPI/nsrsh --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
    --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $extra $exe $iters" 2>&1 | grep "^openmpi" | tee "$out/openmpi-$variant-16x8.txt"
done
