#!/usr/bin/env python3
"""Summarizes session.sh's JSON files: per configuration, one epoch's test accuracy over the seeds
(mean, median, range) and every worker's samples/s added up (median), beside the synchronous
server at the same batch. Usage: summarize.py DIR > summary.txt"""
import collections, json, pathlib, re, statistics, sys

runs = collections.defaultdict(list)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    name = re.sub(r"-seed\d+$", "", path.stem)
    last = json.loads(path.read_text())["epochs"][-1]
    runs[name].append((last["test_accuracy"], last["samples_per_second"], last.get("max_age", 0)))

def stats(name):
    acc = [a for a, _, _ in runs[name]]
    return acc, statistics.mean(acc), statistics.median(acc), statistics.median(s for _, s, _ in runs[name])

print(f"{'configuration':22} {'seeds':>5} {'acc mean':>9} {'median':>7} {'min':>7} {'max':>7} "
      f"{'vs sync (mean)':>14} {'samples/s':>10} {'vs sync':>8} {'max age':>7}")
for name in sorted(runs, key=lambda n: (int(n.split("-")[0][1:]), n)):
    batch = name.split("-")[0]
    acc, mean, median, speed = stats(name)
    _, sync_mean, _, sync_speed = stats(f"{batch}-sync")
    print(f"{name:22} {len(acc):5} {mean:9.4f} {median:7.4f} {min(acc):7.4f} {max(acc):7.4f} "
          f"{100 * (mean - sync_mean):+13.2f}p {speed:10.0f} {speed / sync_speed:7.2f}x "
          f"{max(a for _, _, a in runs[name]):7.0f}")
