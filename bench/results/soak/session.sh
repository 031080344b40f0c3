#!/usr/bin/env bash
# bench/soak on 2 emulated machines of 2 ranks (gradsync-run: shared memory within, TCP across,
# on this host): 4 configurations x ITERS iterations, rank 0's RSS every 100.
# Usage: session.sh OUT_DIR [ITERS]
set -u
out=$1 iters=${2:-2500}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
tools/gradsync-run --machines 2 -n 2 build-release/bench/soak --iters "$iters" --sample-every 100 \
  --json "$out/soak.json" 2>&1 | grep "^\[0\]"
