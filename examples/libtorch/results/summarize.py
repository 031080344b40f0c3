#!/usr/bin/env python3
"""Summarizes session.sh's JSON files: per configuration (the file name without its round), the
rounds' one-epoch step time (seconds / steps), samples/s and test accuracy: medians, and the
ratio of DDP's median step time to each. Usage: summarize.py DIR > summary.txt"""
import collections, json, pathlib, re, statistics, sys

runs = collections.defaultdict(list)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    last = json.loads(path.read_text())["epochs"][-1]
    runs[re.sub(r"-\d+$", "", path.stem)].append(last)

median = lambda name, key: statistics.median(e[key] for e in runs[name])
ddp_step = median("ddp", "step_seconds")
print(f"{'configuration':22} {'rounds':>6} {'ms a step':>10} {'samples/s':>10} {'accuracy':>9} "
      f"{'DDP step / this':>15}  (each round: ms a step / accuracy)")
for name in sorted(runs):
    step = median(name, "step_seconds")
    each = ", ".join(f"{1e3 * e['step_seconds']:.1f} / {e['test_accuracy']:.4f}" for e in runs[name])
    print(f"{name:22} {len(runs[name]):6} {1e3 * step:10.1f} {median(name, 'samples_per_second'):10.0f} "
          f"{median(name, 'test_accuracy'):9.4f} {ddp_step / step:14.2f}x  ({each})")
