#!/usr/bin/env bash
# The README's fmnist table at the current defaults (learning rate 0.1, momentum 0.5, 16 samples
# per rank per step), one epoch, seed 1: one rank at batch 64; 4 ranks on this machine (shared
# memory); 4 emulated hosts at 1 Gbit/s, uncompressed and with bf16. Run from this directory with
# FMNIST set to the trainer (a release or debug-optimized build) and GRADSYNC_TOKEN set.
set -euo pipefail
export PATH=$PATH:/work/shared/tools
"$FMNIST" --batch 64 --seed 1 --json 1-rank-batch64.json
../../../../tools/gradsync-run -n 4 "$FMNIST" --seed 1 --json 4-ranks-shared-memory.json
netcluster up 4 1gbit
netcluster run 4 "$FMNIST" --seed 1 --json netcluster-4-ranks.json
netcluster run 4 "$FMNIST" --seed 1 --codec bf16 --json netcluster-4-ranks-bf16.json
