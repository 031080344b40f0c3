#!/usr/bin/env python3
"""bench/README.md's table of the precise-timers check, from the JSON run.sh (this folder) wrote:
ms per synchronization (median of 10, rank 0) of each build in each round, and their means."""
import glob, json, os, re, statistics
here = os.path.dirname(os.path.abspath(__file__))
runs = {}  # (setting, chunk, config, build) -> [ms by round]
for path in sorted(glob.glob(os.path.join(here, "*.json"))):
    m = re.fullmatch(r"(.+)-chunk(\d+)-(.+)-(old|new)-(\d)\.json", os.path.basename(path))
    runs.setdefault((m.group(1), int(m.group(2)), m.group(3), m.group(4)), []).append(json.load(open(path))["iteration_ms"])
print("| setting | pieces | path, executor | before (rounds 1-2) | with precise timers | means, after/before |")
print("|---------|--------|----------------|---------------------|---------------------|---------------------|")
for setting, chunk, config in sorted({k[:3] for k in runs}, key=lambda k: (k[0] != "contexts", k[1], k[2])):
    old, new = runs[(setting, chunk, config, "old")], runs[(setting, chunk, config, "new")]
    print(f"| {setting} | {chunk} MiB | {config} | {', '.join(f'{t:.1f}' for t in old)} | "
          f"{', '.join(f'{t:.1f}' for t in new)} | {statistics.mean(new) / statistics.mean(old):.2f} |")
