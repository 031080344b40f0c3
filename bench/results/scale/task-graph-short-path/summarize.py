#!/usr/bin/env python3
"""Medians over the rounds of run.sh's JSON (NAME-RANKS-ROUND.json), per configuration, rank count
and size; writes summary.json beside them and prints the table with each configuration's time
relative to the task graph's."""
import json
import pathlib
import re
import statistics

here = pathlib.Path(__file__).parent
runs = {}
for path in sorted(here.glob("*-*-*.json")):
    match = re.fullmatch(r"(.+)-(\d+)-(\d+)\.json", path.name)
    if not match:
        continue
    name, ranks = match.group(1), int(match.group(2))
    for row in json.loads(path.read_text()):
        runs.setdefault((name, ranks, row["bytes"]), []).append(row)

summary = []
for (name, ranks, size), rows in sorted(runs.items(), key=lambda k: (k[0][1], k[0][2], k[0][0])):
    summary.append({"configuration": name, "ranks": ranks, "bytes": size, "rounds": len(rows),
                    "median_time_us": round(statistics.median(r["time_us"] for r in rows), 1),
                    "times_us": [round(r["time_us"], 1) for r in rows],
                    "wrong": sum(r.get("wrong", 0) for r in rows),
                    "schedule": rows[0].get("schedule", rows[0].get("topology", ""))})
(here / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

order = ["task-graph", "serial", "before-serial", "before-task-graph", "openmpi"]
medians = {(s["configuration"], s["ranks"], s["bytes"]): s for s in summary}
print(f"{'ranks':>5} {'bytes':>8} " + " ".join(f"{c:>22}" for c in order))
for ranks, size in sorted({(s["ranks"], s["bytes"]) for s in summary}):
    base = medians.get(("task-graph", ranks, size))
    cells = []
    for c in order:
        s = medians.get((c, ranks, size))
        if not s:
            cells.append(f"{'-':>22}")
            continue
        ratio = f" ({s['median_time_us'] / base['median_time_us']:.2f}x)" if base else ""
        cells.append(f"{s['median_time_us'] / 1e3:>12.2f} ms{ratio:>8}")
    print(f"{ranks:>5} {size:>8} " + " ".join(cells))
