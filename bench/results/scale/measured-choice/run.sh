#!/usr/bin/env bash
# What bench/allreduce does with no flags (topology::Auto: the candidates tried, the fastest kept)
# beside each schedule fixed and Open MPI, allreduce of 4 KiB to 16 MiB, in alternating rounds:
#   default             this checkout's bench/allreduce, no --topology
#   ring, recursive-doubling, halving-doubling   --topology NAME
#   hierarchical        --topology hierarchical (its schedule across machines tried and kept as the
#                       default keeps its own), on hosts of several ranks
#   openmpi-tuned       MPI_Allreduce of the same values (bench/allreduce --collective mpi-allreduce)
#   openmpi-han         ... its hierarchical collectives, on hosts of several ranks
# Each run's JSON goes to this folder (SHAPE-NAME-ROUND.json); summarize.py writes summary.json and
# prints the medians.
# Usage, as root from the repository root, after `meson setup build-release -Dbuildtype=release
# -Dmpi=enabled` and `meson compile -C build-release bench/allreduce`:
#   bench/results/scale/measured-choice/run.sh loopback RANKS [ROUNDS]     one machine, TCP loopback
#   bench/results/scale/measured-choice/run.sh hosts HOSTS PER_HOST [ROUNDS]  netcluster at 1 Gbit/s
#   bench/results/scale/measured-choice/run.sh exploration RANKS   the default once on loopback: its
#     trials (agreed times, iterations and their cost) into exploration-loopback-RANKS.json
set -u
here=$(dirname "$0")
shape=${1:?usage: run.sh loopback RANKS [ROUNDS] | hosts HOSTS PER_HOST [ROUNDS]}
netcluster=${NETCLUSTER:-../shared/tools/netcluster}
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n') GRADSYNC_TCP_CONGESTION=cubic
sizes=(--min-bytes 4K --max-bytes 16M --step-factor 16 --iters 10 --warmup 2)
if [[ $shape == exploration ]]; then
  timeout 1200 tools/gradsync-run -n "${2:?ranks}" build-release/bench/allreduce --transport tcp --local-transport tcp \
    "${sizes[@]}" --json "$here/exploration-loopback-$2.json" 2>&1 | grep -E "^\[0\] (  |# auto)|rror"
  exit
elif [[ $shape == loopback ]]; then
  ranks=${2:?ranks}; rounds=${3:-3}; tag=loopback-$ranks
else
  hosts=${2:?hosts}; per_host=${3:?ranks per host}; rounds=${4:-3}; tag=hosts-${hosts}x$per_host
  "$netcluster" up "$hosts" 1gbit >/dev/null
  nsrsh=$(cd "${OPENMPI_TOOLS:-../shared/tools/openmpi}" && pwd)/nsrsh
  host_list=$(for ((i = 0; i < hosts; i++)); do printf 'gs%d:%d,' "$i" "$per_host"; done)
fi
gradsync() {  # NAME [ARGS...]
  local name=$1
  shift
  echo "== $name, $tag, round $round"
  local run=(build-release/bench/allreduce --transport tcp "${sizes[@]}" --json "$here/$tag-$name-$round.json" "$@")
  if [[ $shape == loopback ]]; then
    timeout 1200 tools/gradsync-run -n "$ranks" "${run[@]}" --local-transport tcp
  else
    RANKS_PER_HOST=$per_host timeout 1200 "$netcluster" run "$hosts" "${run[@]}"
  fi 2>&1 | grep -E "^\[0\]  |rror|gradsync: rank"
}
openmpi() {  # NAME [MCA OPTIONS...]
  local name=$1
  shift
  echo "== $name, $tag, round $round"
  local run="$PWD/build-release/bench/allreduce --transport mpi --collective mpi-allreduce ${sizes[*]} --json $PWD/$here/$tag-$name-$round.json"
  if [[ $shape == loopback ]]; then
    timeout 1200 mpirun --allow-run-as-root --oversubscribe -n "$ranks" --mca btl self,tcp --mca mpi_yield_when_idle 1 $run
  else
    ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec timeout 1200 mpirun --allow-run-as-root \
      -n $((hosts * per_host)) --host ${host_list%,} --mca plm_rsh_agent $nsrsh --mca btl_tcp_if_include 10.77.0.0/24 \
      --mca oob_tcp_if_include 10.77.0.0/24 --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $* $run"
  fi 2>&1 | grep -E "^  |rror"
}
for round in $(seq 1 "$rounds"); do
  gradsync default
  openmpi openmpi-tuned
  gradsync ring --topology ring
  # Fixed recursive doubling holds 2 log2(p) whole buckets: at 128 ranks of 16 MiB, 224 MiB a rank,
  # more than the 16 x 8 ranks' machine holds; on hosts it stops at 1 MiB.
  gradsync recursive-doubling --topology recursive-doubling $([[ $shape == hosts ]] && echo --max-bytes 1M)
  gradsync halving-doubling --topology halving-doubling
  if [[ $shape == hosts && $per_host -gt 1 ]]; then
    gradsync hierarchical --topology hierarchical
    openmpi openmpi-han --mca coll_han_priority 100
  fi
done
python3 "$here/summarize.py"
