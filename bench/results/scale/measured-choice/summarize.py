#!/usr/bin/env python3
"""Medians over the rounds of run.sh's JSON (SHAPE-NAME-ROUND.json), per shape, configuration and
size; writes summary.json beside them and prints, per shape, each configuration's time relative to
the default's, the schedule the default kept in each round, and what its trials cost: the time of
the iterations before the timed ones beyond as many of the kept schedule, as a share of 50
iterations of it (median over the rounds)."""
import json
import pathlib
import re
import statistics

here = pathlib.Path(__file__).parent
runs = {}
for path in sorted(here.glob("*.json")):
    match = re.fullmatch(r"((?:loopback|hosts)-[0-9x]+)-(.+)-(\d+)\.json", path.name)
    if not match:
        continue
    for row in json.loads(path.read_text()):
        runs.setdefault((match.group(1), match.group(2), row["bytes"]), []).append(row)

summary = []
for (shape, name, size), rows in sorted(runs.items()):
    summary.append({"shape": shape, "configuration": name, "bytes": size, "rounds": len(rows),
                    "median_time_us": round(statistics.median(r["time_us"] for r in rows), 1),
                    "times_us": [round(r["time_us"], 1) for r in rows],
                    "wrong": sum(r.get("wrong", 0) for r in rows),
                    "exploration_of_50": [round((r["trials_us"] - r["trial_iterations"] * r["time_us"]) /
                                                (50 * r["time_us"]), 4) for r in rows if "trials_us" in r],
                    "schedules": [r.get("schedule", r.get("topology", "")) +
                                  (f" ({'leader, ' if r.get('within') == 'leader' else ''}{r['across']} across)"
                                   if r.get("across") else "") for r in rows]})
(here / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

order = ["default", "ring", "recursive-doubling", "halving-doubling", "hierarchical", "openmpi-tuned", "openmpi-han"]
medians = {(s["shape"], s["configuration"], s["bytes"]): s for s in summary}
for shape in sorted({s["shape"] for s in summary}):
    present = [c for c in order if any(k[0] == shape and k[1] == c for k in medians)]
    print(f"\n{shape}\n{'bytes':>9} " + " ".join(f"{c:>21}" for c in present) + "  trials  default kept")
    for size in sorted({s["bytes"] for s in summary if s["shape"] == shape}):
        base = medians.get((shape, "default", size))
        cells = []
        for c in present:
            s = medians.get((shape, c, size))
            if not s:
                cells.append(f"{'-':>21}")
                continue
            ratio = f" ({s['median_time_us'] / base['median_time_us']:.2f}x)" if base else ""
            cells.append(f"{s['median_time_us'] / 1e3:>11.2f} ms{ratio:>8}")
        kept = ", ".join(base["schedules"]) if base else ""
        cost = f"{statistics.median(base['exploration_of_50']):>6.1%}" if base and base["exploration_of_50"] else f"{'-':>6}"
        print(f"{size:>9} " + " ".join(cells) + f"  {cost}  " + kept)
