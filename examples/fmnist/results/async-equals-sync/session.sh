#!/usr/bin/env bash
# The asynchronous parameter server at staleness 0, quorum N (the default), period 1 against the
# synchronous parameter server: 4 emulated hosts at 1 Gbit/s, seed 1, one epoch. Run from this
# directory with build/examples on PATH and GRADSYNC_TOKEN set.
set -euo pipefail
netcluster up 4 1gbit
netcluster run 4 fmnist --topology parameter-server --seed 1 --epochs 1 --json sync.json
netcluster run 4 fmnist --topology parameter-server --seed 1 --epochs 1 --staleness 0 --period 1 --json async.json
