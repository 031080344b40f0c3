#!/usr/bin/env bash
# The receive short path (transport::Tcp: a caller waiting for a receive reads its peer's sockets
# itself) against the library without it, alternating, then Open MPI, in one session: 64 ranks on
# TCP loopback, Auto, serial executor, 4 KiB / 64 KiB / 1 MiB, slowest rank's median of ITERS.
# The same bench/allreduce binary runs both: BEFORE is a directory holding libgradsync.so.0 built
# without the short path, put first by LD_LIBRARY_PATH (the binary's RUNPATH comes after it).
# Run on 2026-11-28 with build/ at 9ca58ac plus short-path.patch (beside this script), BEFORE built
# from 9ca58ac; the short path was not kept (bench/README.md, "many ranks").
# Each run's whole output is kept beside its JSON (NAME.log).
# Usage: session.sh OUT BEFORE_LIB_DIR [ROUNDS] [ITERS] [N]   (from the repository root, after a build in build/)
set -u
out=$1 before=$2 rounds=${3:-2} iters=${4:-10} n=${5:-64}
mkdir -p "$out"
ulimit -n 20000
run() {  # run NAME [LD_LIBRARY_PATH]
  echo "== $1, $n ranks"
  LD_LIBRARY_PATH=${2:-} tools/gradsync-run -n "$n" build/bench/allreduce --transport tcp --local-transport tcp \
    --topology auto --executor serial --min-bytes 4K --max-bytes 1M --step-factor 16 --iters "$iters" --warmup 2 \
    --json "$out/$1.json" 2>&1 | tee "$out/$1.log" | grep -E "^\[0\] ( |# link)"
}
for ((round = 1; round <= rounds; ++round)); do
  run "before-$round-$n" "$before"
  run "short-path-$round-$n"
  echo "== Open MPI, $n ranks"
  /work/shared/tools/openmpi/small "$n" "$iters" 2>&1 | tee "$out/openmpi-$round-$n.txt"
done
