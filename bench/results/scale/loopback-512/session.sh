#!/usr/bin/env bash
# How gradsync-auto-serial-512.json was made (from the repository root, after a build in build/).
ulimit -n 20000
tools/gradsync-run -n 512 build/bench/allreduce --transport tcp --local-transport tcp --topology auto --executor serial \
  --min-bytes 4K --max-bytes 1M --step-factor 16 --iters 5 --warmup 2 \
  --json bench/results/scale/loopback-512/gradsync-auto-serial-512.json
