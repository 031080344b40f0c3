#!/usr/bin/env python3
"""Medians over the rounds of run.sh's JSON (NAME-ROUND.json), per configuration and size; writes
summary.json beside them and prints the table with each configuration's time relative to the task
graph's."""
import json
import pathlib
import re
import statistics

here = pathlib.Path(__file__).parent
runs = {}
for path in sorted(here.glob("*-*.json")):
    match = re.fullmatch(r"(.+)-(\d+)\.json", path.name)
    if not match:
        continue
    for row in json.loads(path.read_text()):
        runs.setdefault((match.group(1), row["bytes"]), []).append(row)

summary = []
for (name, size), rows in sorted(runs.items(), key=lambda k: (k[0][1], k[0][0])):
    summary.append({"configuration": name, "hosts": 16, "ranks_per_host": 8, "bytes": size, "rounds": len(rows),
                    "median_time_us": round(statistics.median(r["time_us"] for r in rows), 1),
                    "times_us": [round(r["time_us"], 1) for r in rows],
                    "wrong": sum(r.get("wrong", 0) for r in rows),
                    # per round: topology::Auto chooses from each run's own measured link
                    "schedules": [r.get("schedule", r.get("topology", "")) for r in rows]})
(here / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

order = ["task-graph", "before-task-graph", "openmpi-tuned", "openmpi-han"]
medians = {(s["configuration"], s["bytes"]): s for s in summary}
print(f"{'bytes':>9} " + " ".join(f"{c:>22}" for c in order))
for size in sorted({s["bytes"] for s in summary}):
    base = medians.get(("task-graph", size))
    cells = []
    for c in order:
        s = medians.get((c, size))
        if not s:
            cells.append(f"{'-':>22}")
            continue
        ratio = f" ({s['median_time_us'] / base['median_time_us']:.2f}x)" if base else ""
        cells.append(f"{s['median_time_us'] / 1e3:>12.2f} ms{ratio:>8}")
    print(f"{size:>9} " + " ".join(cells))
