#!/usr/bin/env python3
"""Medians over the rounds of run.sh's JSON (TRACE-POLICY-BUILD-ROUND.json) of the per-round
median iteration time; writes summary.json beside them and prints the table, with this checkout's
time relative to the earlier commit's."""
import json
import pathlib
import re
import statistics

here = pathlib.Path(__file__).parent
runs = {}
for path in sorted(here.glob("*.json")):
    match = re.fullmatch(r"(.+)-(per-tensor|time-clustered)-(now|before)-(\d+)\.json", path.name)
    if not match:
        continue
    run = json.loads(path.read_text())
    runs.setdefault((match.group(1), match.group(2), match.group(3)), []).append(run)

summary = []
for (trace, policy, build), rounds in sorted(runs.items()):
    summary.append({"trace": trace, "policy": policy, "build": build, "rounds": len(rounds),
                    "median_iteration_ms": round(statistics.median(r["iteration_ms"] for r in rounds), 1),
                    "iteration_ms": [r["iteration_ms"] for r in rounds],
                    "median_exposed_ms": round(statistics.median(r["exposed_ms"] for r in rounds), 1),
                    "buckets": rounds[0]["buckets"], "topology": rounds[0]["topology"],
                    "executor": rounds[0]["executor"]})
(here / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

medians = {(s["trace"], s["policy"], s["build"]): s for s in summary}
print(f"{'trace':<10} {'bucketing':<15} {'now (ms)':>10} {'before (ms)':>12} {'now/before':>11}")
for trace, policy in sorted({(s["trace"], s["policy"]) for s in summary}):
    now, before = medians.get((trace, policy, "now")), medians.get((trace, policy, "before"))
    cell = lambda s: f"{s['median_iteration_ms']:.1f}" if s else "-"
    ratio = f"{now['median_iteration_ms'] / before['median_iteration_ms']:.2f}x" if now and before else "-"
    print(f"{trace:<10} {policy:<15} {cell(now):>10} {cell(before):>12} {ratio:>11}")
