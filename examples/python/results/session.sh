#!/usr/bin/env bash
# examples/python/train.py five ways on 4 emulated hosts at 1 Gbit/s, one epoch each, three rounds
# (the configurations alternating within a round). Run from this directory with gradsync's build
# on PYTHONPATH (build/python) and GRADSYNC_TOKEN set.
# Gloo takes the address the host name resolves to (loopback here): each rank names its host's
# link (netcluster's host i has v<i>p).
set -euo pipefail
netcluster up 4 1gbit
train="env-gloo /usr/bin/python3 $(cd .. && pwd)/train.py --epochs 1 --seed 1"
bin=$(mktemp -d) && trap 'rm -rf "$bin"' EXIT
printf '#!/bin/sh\nGLOO_SOCKET_IFNAME=v${RANK}p exec "$@"\n' > "$bin/env-gloo" && chmod +x "$bin/env-gloo"
export PATH="$bin:$PATH"
for round in 1 2 3; do
  netcluster run 4 $train --mode ddp --json ddp-$round.json
  netcluster run 4 $train --mode ddp-fp16 --json ddp-fp16-$round.json
  netcluster run 4 $train --mode ddp-powersgd --json ddp-powersgd-$round.json
  netcluster run 4 $train --mode hook --codec none --json hook-none-$round.json
  netcluster run 4 $train --mode hook --codec ef-two-bit --json hook-ef-two-bit-$round.json
  netcluster run 4 $train --mode optimizer --codec ef-two-bit --json optimizer-ef-two-bit-$round.json
done
