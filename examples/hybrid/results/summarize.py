#!/usr/bin/env python3
"""Summarizes a session.sh directory: per mode and update placement, the median over rounds of the
step time, throughput and the job's bytes a step, the range of test accuracy, and the median time
the fc-holding ranks spent in SGD after wait(). Usage: summarize.py OUT_DIR"""
import json, pathlib, statistics, sys

runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text())
    runs.setdefault((d["mode"], d["updates"]), []).append(d)

print(f"{'mode':<14} {'updates':<11} {'runs':>4} {'step ms':>8} {'samples/s':>9} {'MB/step':>8} "
      f"{'accuracy':>15} {'update s':>8}")
for (mode, updates), ds in sorted(runs.items()):
    epochs = [d["epochs"][-1] for d in ds]
    # The ranks that hold fc layers: the second half in hybrid mode, every rank in data parallel.
    fc_ranks = lambda d: range(d["ranks"] // 2, d["ranks"]) if mode == "hybrid" else range(d["ranks"])
    update = statistics.median(max(e["rank_update_seconds"][k] for k in fc_ranks(d)) for d, e in zip(ds, epochs))
    accuracy = sorted(e["test_accuracy"] for e in epochs)
    print(f"{mode:<14} {updates:<11} {len(ds):>4} {statistics.median(e['step_ms'] for e in epochs):>8.1f} "
          f"{statistics.median(e['samples_per_second'] for e in epochs):>9.0f} "
          f"{statistics.median(e['job_bytes_per_step'] for e in epochs) / 1e6:>8.2f} "
          f"{accuracy[0]:.4f}-{accuracy[-1]:.4f} {update:>8.2f}")
