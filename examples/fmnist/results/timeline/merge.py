#!/usr/bin/env python3
"""Merges the per-rank timelines session.sh wrote (CODEC.RANK.json) into one trace per codec
(CODEC.json): the ranks ran on one machine, so their monotonic clocks are one clock and their
events line up; each rank stays its own process (pid = rank). Usage: merge.py DIR"""
import json, pathlib, re, sys

folder = pathlib.Path(sys.argv[1])
for codec in sorted({re.sub(r"\.\d+$", "", p.stem) for p in folder.glob("*.*.json")}):
    ranks = sorted(folder.glob(f"{codec}.*.json"), key=lambda p: int(p.stem.rsplit(".", 1)[1]))
    traces = [json.loads(p.read_text()) for p in ranks]
    merged = {"displayTimeUnit": "ms", "traceEvents": [e for t in traces for e in t["traceEvents"]],
              "otherData": {"ranks": len(traces), "dropped": sum(t["otherData"]["dropped"] for t in traces)}}
    (folder / f"{codec}.json").write_text(json.dumps(merged, separators=(",", ":")))
    for p in ranks:
        p.unlink()
    print(f"{codec}.json: {len(ranks)} ranks, {len(merged['traceEvents'])} events, {merged['otherData']['dropped']} dropped")
