#!/usr/bin/env python3
"""Events a synchronization recorded, from session.sh's trace files (rank 0, last round), by name.
Usage: count_events.py DIR > events.txt   (the traces themselves, ~30 MB a rank, are not kept)"""
import collections, json, pathlib, sys

for trace_dir in sorted(pathlib.Path(sys.argv[1]).glob("trace-*")):
    trace = json.loads((trace_dir / "trace.0.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] not in ("M", "e")]  # an async pair counts once
    syncs = sum(1 for e in events if e["name"] == "wait")
    kinds = collections.Counter(e["name"].split(" ")[0] for e in events)
    print(f"{trace_dir.name}: {len(events)} events over {syncs} synchronizations, {len(events) / syncs:.0f} each, "
          f"{trace['otherData']['dropped']} dropped; per synchronization: "
          + ", ".join(f"{k} {v / syncs:.0f}" for k, v in sorted(kinds.items())))
