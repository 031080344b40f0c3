#!/usr/bin/env bash
# Setup at N ranks on this machine over TCP loopback, in one run: gradsync's Tcp (bench/setup, the
# slowest rank's median over ROUNDS), Open MPI's MPI_Init + barrier (tools/openmpi/small, TCP only)
# and torch.distributed's gloo init + barrier (bench/gloo_setup.py, the slowest rank's median over
# ROUNDS, up to GLOO_MAX ranks: each Python process with torch holds ~150 MB).
# Usage: setup.sh OUT_DIR N... (from the repository root, after a build in build/)
set -u
out=$1; shift
rounds=${ROUNDS:-3} gloo_max=${GLOO_MAX:-64}
mkdir -p "$out"
ulimit -n 20000
for n in "$@"; do
  echo "== gradsync bench/setup, $n ranks"
  tools/gradsync-run -n "$n" build/bench/setup --rounds "$rounds" --json "$out/gradsync-setup-$n.json" 2>&1 |
    grep -E "^\[0\] (round|median)"
  echo "== Open MPI, $n ranks"
  /work/shared/tools/openmpi/small "$n" 3 2>&1 | grep init | tee "$out/openmpi-$n.txt"
  if (( n <= gloo_max )); then
    echo "== torch gloo, $n ranks"
    tools/gradsync-run -n "$n" /usr/bin/python3 bench/gloo_setup.py --rounds "$rounds" --json "$out/gloo-setup-$n.json" 2>&1 |
      grep -E "^\[0\] (round|gloo)"
  fi
done
