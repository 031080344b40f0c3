#!/usr/bin/env bash
# Replayed training steps (bench/replay) on the default executor of this checkout against the same
# of an earlier commit, alternating, on 4 emulated hosts at 1 Gbit/s (netcluster): ResNet-50 and
# BERT-base, per-tensor and time-clustered bucketing. Each run's JSON goes to this folder
# (TRACE-POLICY-BUILD-ROUND.json, BUILD "now" or "before"); summarize.py writes summary.json and
# prints the medians.
# Usage, as root from the repository root, after `meson setup build-release -Dbuildtype=release`
# and a build of the earlier commit (git worktree add ../before COMMIT; meson setup ../before/build
# -Dbuildtype=release ...; meson compile -C ../before/build bench/replay):
#   bench/results/replay/one-engine/run.sh BEFORE_BUILD [ROUNDS]
set -u
before=${1:?usage: run.sh BEFORE_BUILD [ROUNDS]}
rounds=${2:-3}
here=$(dirname "$0")
netcluster=${NETCLUSTER:-../shared/tools/netcluster}
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n') GRADSYNC_TCP_CONGESTION=cubic
"$netcluster" up 4 1gbit >/dev/null
for round in $(seq 1 "$rounds"); do
  for trace in resnet50 bert-base; do
    for policy in per-tensor time-clustered; do
      for build in now before; do
        dir=build-release
        [[ $build == before ]] && dir=$before
        name=$trace-$policy-$build-$round
        echo "== $name"
        "$netcluster" run 4 "$dir/bench/replay" --trace "bench/traces/$trace.trace" --bucketing "$policy" \
          --iters 15 --warmup 8 --json "$here/$name.json" 2>&1 | grep -E "^\[0\] [^#]"
      done
    done
  done
done
python3 "$here/summarize.py"
