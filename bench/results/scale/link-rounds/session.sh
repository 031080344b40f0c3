#!/usr/bin/env bash
# Auto's link measured by the butterfly's rounds (engine::calibrate_link since 2026-11-28) against
# the ring neighbour's exchanges it measured before: bench/allreduce built before the change
# (BEFORE, a path to the binary) and from build/, alternating, on 16 emulated hosts x 8 ranks at
# 1 Gbit/s (netcluster), all TCP, Auto, serial executor, 4 KiB to 4 MiB by 4x; then halving-doubling
# and recursive doubling alone (build/), then Open MPI tuned (4 KiB, 64 KiB, 1 MiB; OPENMPI=no
# leaves it out), in one session. The first run (2026-11-28, the defaults) named its files
# auto-ring-probe-R and auto-butterfly-rounds-R; they are now TOPOLOGY-before-R and TOPOLOGY-rounds-R.
# Usage: session.sh OUT BEFORE [ROUNDS] [ITERS] [TOPOLOGY] [REFERENCES...]   (root; from the
# repository root, after a build in build/). TOPOLOGY (default auto) is what runs before and
# after; REFERENCES (default halving-doubling recursive-doubling) run once each after, a
# topology with bench/allreduce options after commas (hosts.sh's form: hierarchical,--across,ring).
# AFTER (default "rounds") names the runs of build/: TOPOLOGY-AFTER-R. Each run's whole output is
# kept beside its JSON (NAME.log).
set -u
out=$1 before=$2 rounds=${3:-2} iters=${4:-10} topology=${5:-auto}
shift $(( $# >= 5 ? 5 : $# ))
references=("$@")
[[ ${#references[@]} -gt 0 ]] || references=(halving-doubling recursive-doubling)
mkdir -p "$out"
ulimit -n 20000
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
OMPI=/work/shared/tools/openmpi
$NC up 16 1gbit >/dev/null
run() {  # run NAME BINARY TOPOLOGY[,OPTIONS]
  local words
  IFS=, read -r -a words <<< "$3"
  echo "== $1"
  RANKS_PER_HOST=8 $NC run 16 "$2" --transport tcp --local-transport tcp --topology "${words[@]}" --executor serial \
    --min-bytes 4K --max-bytes 4M --step-factor 4 --iters "$iters" --warmup 2 --json "$out/$1.json" 2>&1 |
    tee "$out/$1.log" | grep -E "^\[0\] ( |# link)"
}
for ((round = 1; round <= rounds; ++round)); do
  run "$topology-before-$round" "$before" "$topology"
  run "$topology-${AFTER:-rounds}-$round" build/bench/allreduce "$topology"
done
for reference in "${references[@]}"; do
  name=${reference//,--/-}
  run "${name//,/-}" build/bench/allreduce "$reference"
done
exe=/tmp/openmpi-allreduce-small
[[ ${OPENMPI:-yes} == no ]] && exit 0
[ "$exe" -nt "$OMPI/allreduce_small.c" ] || mpicc -O2 "$OMPI/allreduce_small.c" -o "$exe"
hosts=$(for ((i = 0; i < 16; i++)); do printf 'gs%d:8,' "$i"; done)
echo "== Open MPI (tuned), 16 hosts x 8 ranks"
ip netns exec gs0 unshare --uts sh -c "hostname gs0; exec mpirun --allow-run-as-root -n 128 --host ${hosts%,} \
  --mca plm_rsh_agent $OMPI/nsrsh --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 $exe $iters" 2>&1 | grep "^openmpi" | tee "$out/openmpi-tuned.txt"
