#!/usr/bin/env bash
# 16 emulated hosts x 8 ranks at 1 Gbit/s (netcluster): allreduce of 4 KiB to 16 MiB, side by
# side in alternating rounds:
#   task-graph         this checkout's bench/allreduce, --topology auto, default executor and transports
#   before-task-graph  the same of an earlier commit (its build in BEFORE)
#   openmpi-tuned      MPI_Allreduce of the same values (bench/allreduce --collective mpi-allreduce),
#                      Open MPI's default collectives, shared memory within a host, TCP across
#   openmpi-han        ... its hierarchical collectives (coll_han_priority 100)
# Each run's JSON goes to this folder (NAME-ROUND.json); summarize.py writes summary.json and
# prints the medians. Open MPI is started inside host 0 with ../shared/tools/openmpi/nsrsh
# starting its daemons in the other hosts' namespaces.
# Usage, as root from the repository root, after `meson setup build-release -Dbuildtype=release
# -Dmpi=enabled` and a build of the earlier commit:
#   bench/results/scale/one-engine-hosts/run.sh BEFORE_BUILD [ROUNDS]
set -u
before=${1:?usage: run.sh BEFORE_BUILD [ROUNDS]}
rounds=${2:-3}
here=$(dirname "$0")
netcluster=${NETCLUSTER:-../shared/tools/netcluster}
nsrsh=$(cd "${OPENMPI_TOOLS:-../shared/tools/openmpi}" && pwd)/nsrsh
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n') GRADSYNC_TCP_CONGESTION=cubic
sizes=(--min-bytes 4K --max-bytes 16M --step-factor 16 --iters 10 --warmup 2)
"$netcluster" up 16 1gbit >/dev/null
hosts=$(for ((i = 0; i < 16; i++)); do printf 'gs%d:8,' "$i"; done)
gradsync() {  # NAME BUILD
  echo "== $1, round $round"
  RANKS_PER_HOST=8 timeout 900 "$netcluster" run 16 "$2/bench/allreduce" --transport tcp --topology auto "${sizes[@]}" \
    --json "$here/$1-$round.json" 2>&1 | grep -E "^\[0\]  |rror"
}
openmpi() {  # NAME [MCA OPTIONS...]
  local name=$1
  shift
  echo "== $name, round $round"
  ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec timeout 900 mpirun --allow-run-as-root -n 128 \
    --host ${hosts%,} --mca plm_rsh_agent $nsrsh --mca btl_tcp_if_include 10.77.0.0/24 \
    --mca oob_tcp_if_include 10.77.0.0/24 --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $* \
    $PWD/build-release/bench/allreduce --transport mpi --collective mpi-allreduce ${sizes[*]} \
    --json $PWD/$here/$name-$round.json" 2>&1 | grep -E "^  |rror"
}
for round in $(seq 1 "$rounds"); do
  gradsync task-graph build-release
  openmpi openmpi-tuned
  gradsync before-task-graph "$before"
  openmpi openmpi-han --mca coll_han_priority 100
done
python3 "$here/summarize.py"
