#!/usr/bin/env bash
# Side by side: HAN, this build, the build before (commit 31ca0c3, its bench/allreduce and libraries copied to /tmp/old), ef-two-bit; rounds 1..R.
set -u
cd /work/main
out=${OUT:-/tmp/hier-taper}; mkdir -p $out
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p) GRADSYNC_TCP_CONGESTION=cubic
NC=/work/shared/tools/netcluster
args="--transport tcp --topology hierarchical --executor task-graph --min-bytes ${MIN:-1M} --max-bytes ${MAX:-64M} --step-factor 4 --iters ${ITERS:-5} --warmup 5"
for r in $(seq 1 ${ROUNDS:-3}); do
  echo "== HAN $r"; /work/shared/tools/openmpi/run 2 4 --mca mpi_yield_when_idle 1 --mca coll_han_priority 100 2>&1 | tee $out/openmpi-han-$r.txt | grep -v "^$"
  echo "== tapered $r"; RANKS_PER_HOST=4 $NC run 2 ./build-release/bench/allreduce $args --json $out/tapered-$r.json 2>&1 | grep "^\[0\]" | grep -v "#  "
  echo "== before $r"; RANKS_PER_HOST=4 $NC run 2 /tmp/old/bench/allreduce $args --json $out/before-$r.json 2>&1 | grep "^\[0\]" | grep -E "^\[0\] +[0-9]"
  echo "== tapered ef-two-bit $r"; RANKS_PER_HOST=4 $NC run 2 ./build-release/bench/allreduce $args --codec ef-two-bit --json $out/tapered-ef-two-bit-$r.json 2>&1 | grep "^\[0\]" | grep -E "^\[0\] +[0-9]"
done
