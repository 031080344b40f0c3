#!/usr/bin/env python3
"""bench/README.md's tables of the exchange on an H100, from the JSON that run.sh (this folder) and
tools/device-check (../device-check-h100, setting "replay") wrote, or from the folders named as
arguments (a later tools/device-check archive, unpacked): ms per synchronization (median
of 10, rank 0) in each round and their mean, and rank 0's CPU time (user + system) per synchronization."""
import glob, json, os, re, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
runs = {}  # (folder, setting, chunk, config) -> [(round, ms, cpu ms)]
for folder in sys.argv[1:] or (here, os.path.join(here, "..", "device-check-h100")):
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        m = re.fullmatch(r"(.+)-chunk(\d+)-(.+)-(\d)\.json", os.path.basename(path))
        if not m or m.group(1) == "codecs":
            continue
        d = json.load(open(path))
        key = (os.path.basename(folder), m.group(1), int(m.group(2)), m.group(3))
        runs.setdefault(key, []).append((int(m.group(4)), d["iteration_ms"], d["cpu_user_ms"] + d["cpu_system_ms"]))
labels = {"host-serial": "CPU codecs, serial", "host-task-graph": "CPU codecs, task graph",
          "device-serial": "GPU, host mirrors, serial", "device-task-graph": "GPU, host mirrors, task graph",
          "ipc-serial": "GPU, CUDA IPC, serial", "ipc-task-graph": "GPU, CUDA IPC, task graph",
          "device-task-graph-spin": "GPU, host mirrors, task graph polling 100 us",
          "ipc-task-graph-spin": "GPU, CUDA IPC, task graph polling 100 us"}
for folder, setting in sorted({k[:2] for k in runs}):
    print(f"\n{folder}: {setting}\n")
    print("| pieces | codecs, path, executor | ms per synchronization, rounds 1-2 | mean | CPU (ms), rounds 1-2 | vs serial (means) |")
    print("|--------|------------------------|------------------------------------|------|----------------------|-------------------|")
    for chunk in sorted({k[2] for k in runs if k[:2] == (folder, setting)}):
        for config in labels:
            rs = sorted(runs.get((folder, setting, chunk, config), []))
            if not rs:
                continue
            med = statistics.mean(r[1] for r in rs)
            serial = runs.get((folder, setting, chunk, re.sub(r"task-graph.*", "serial", config)))
            ratio = f"{statistics.mean(r[1] for r in serial) / med:.2f}x" if "task-graph" in config and serial else ""
            print(f"| {chunk} MiB | {labels[config]} | {', '.join(f'{r[1]:.1f}' for r in rs)} | {med:.1f} | "
                  f"{', '.join(f'{r[2]:.1f}' for r in rs)} | {ratio} |")
