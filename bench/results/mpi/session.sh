#!/usr/bin/env bash
# transport::Mpi beside transport::Tcp and Open MPI's own MPI_Allreduce, on emulated hosts at 1 Gbit/s,
# 1 MiB and 64 MiB, uncompressed and ef-two-bit, ROUNDS rounds alternating every configuration.
#   4 hosts x 1 rank: the ring; 2 hosts x 4 ranks: hierarchical (shared memory within a host),
#   MPI_Allreduce with Open MPI's default collectives (tuned) and with HAN.
# Needs root, netcluster, Debian's openmpi-bin and a build with MPI (BUILD, default build-release).
# MPI_OPTS: mpirun options for every MPI run (e.g. Open MPI's TCP eager limit). SHAPES: which of
# 4x1 and 2x4 to run (default both). HIERARCHICAL: more options for the 2x4 runs (--across ring pins
# the schedule across machines, which --across auto picks by links measured at the start).
# Writes OUT/*.json (bench/allreduce --json) and prints the tables; summarize.py tabulates them.
set -u
cd /work/main
out=${OUT:-$PWD/bench/results/mpi}; build=${BUILD:-build-release}; mkdir -p $out
NC=/work/shared/tools/netcluster OMPI=/work/shared/tools/openmpi
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
sizes="--min-bytes 1M --max-bytes 64M --step-factor 64 --iters ${ITERS:-5} --warmup 3"
exe="$PWD/$build/bench/allreduce"

# mpirun inside host 0, its daemons started in the other hosts' namespaces (as $OMPI/run does).
mpi() {  # mpi HOSTS RANKS_PER_HOST [mpirun options] -- [allreduce options]
  local h=$1 l=$2 hosts=""; shift 2
  local opts=(); while [ "$1" != "--" ]; do opts+=("$1"); shift; done; shift
  for ((i = 0; i < h; i++)); do hosts+="gs$i:$l,"; done
  ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec mpirun --allow-run-as-root -n $((h * l)) --host ${hosts%,} \
    --mca plm_rsh_agent $OMPI/nsrsh --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
    --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 ${MPI_OPTS:-} ${opts[*]} $exe $*"
}
table() { grep -E "^(\[0\] +)? +[0-9]+ " || true; }

shapes=${SHAPES:-4x1 2x4}; hier="--topology hierarchical ${HIERARCHICAL:-}"
$NC down >/dev/null 2>&1
if [[ $shapes == *4x1* ]]; then
$NC up 4 1gbit >/dev/null
for r in $(seq 1 ${ROUNDS:-3}); do
  for codec in none ef-two-bit; do
    echo "== 4x1 tcp $codec $r"; $NC run 4 $exe --transport tcp --codec $codec $sizes --json $out/4x1-tcp-$codec-$r.json 2>&1 | table
    echo "== 4x1 mpi $codec $r"; mpi 4 1 -- --transport mpi --codec $codec $sizes --json $out/4x1-mpi-$codec-$r.json 2>&1 | table
  done
  echo "== 4x1 MPI_Allreduce tuned $r"; mpi 4 1 -- --transport mpi --collective mpi-allreduce $sizes --json $out/4x1-mpi-allreduce-tuned-$r.json 2>&1 | table
done
$NC down >/dev/null
fi
if [[ $shapes == *2x4* ]]; then
$NC up 2 1gbit >/dev/null
for r in $(seq 1 ${ROUNDS:-3}); do
  for codec in none ef-two-bit; do
    echo "== 2x4 tcp $codec $r"; RANKS_PER_HOST=4 $NC run 2 $exe --transport tcp $hier --codec $codec $sizes --json $out/2x4-tcp-$codec-$r.json 2>&1 | table
    echo "== 2x4 mpi $codec $r"; mpi 2 4 -- --transport mpi $hier --codec $codec $sizes --json $out/2x4-mpi-$codec-$r.json 2>&1 | table
  done
  echo "== 2x4 MPI_Allreduce tuned $r"; mpi 2 4 -- --transport mpi --collective mpi-allreduce $sizes --json $out/2x4-mpi-allreduce-tuned-$r.json 2>&1 | table
  echo "== 2x4 MPI_Allreduce HAN $r"; mpi 2 4 --mca coll_han_priority 100 -- --transport mpi --collective mpi-allreduce $sizes --json $out/2x4-mpi-allreduce-han-$r.json 2>&1 | table
done
$NC down >/dev/null
fi
