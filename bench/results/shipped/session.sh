#!/usr/bin/env bash
# bench/replay before and after the shipped combinations (make_synchronizer behind AnySynchronizer
# instead of a Synchronizer compiled into replay.cpp), side by side on 4 emulated hosts at 1 Gbit/s,
# alternating the two builds, 3 runs each. OLD and NEW are the two builds' bench/replay (both
# configured as CI's: -O1, no debug information).
#   OLD=/work/old/build/bench/replay NEW=/work/main/build/bench/replay bash session.sh
set -euo pipefail
cd "$(dirname "$0")"
export PATH=$PATH:/work/shared/tools GRADSYNC_TOKEN=shipped
traces=/work/main/bench/traces
netcluster up 4 1gbit >/dev/null
for run in 1 2 3; do
  for build in old new; do
    binary=$OLD
    [[ $build == new ]] && binary=$NEW
    netcluster run 4 "$binary" --trace "$traces/vgg19.trace" --json "$PWD/vgg19-none-$build-$run.json" >/dev/null
    netcluster run 4 "$binary" --trace "$traces/resnet50.trace" --json "$PWD/resnet50-none-$build-$run.json" >/dev/null
    netcluster run 4 "$binary" --trace "$traces/resnet50.trace" --codec ef-two-bit \
      --json "$PWD/resnet50-ef-two-bit-$build-$run.json" >/dev/null
  done
done
python3 - <<'PY'
import glob, json, statistics
rows = {}
for path in sorted(glob.glob("*-[0-9].json")):
    name = path.rsplit("-", 2)[0]; build = path.rsplit("-", 2)[1]
    rows.setdefault(name, {}).setdefault(build, []).append(json.load(open(path))["iteration_ms"])
print(f"{'trace, codec':>22} {'before (ms)':>12} {'after (ms)':>12} {'after/before':>13}")
for name, b in rows.items():
    old, new = statistics.median(b["old"]), statistics.median(b["new"])
    print(f"{name:>22} {old:>12.1f} {new:>12.1f} {new / old:>13.3f}")
PY
