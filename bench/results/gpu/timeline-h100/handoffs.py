#!/usr/bin/env python3
"""What the timelines in timeline-h100.tar.gz (run.sh) say of one synchronization, each figure the
mean over the 4 ranks of iterations 3-7 (after the plan and the warm-ups): its length; the compute
thread's busy time (queueing the device kernels); the median send and receive, post to completion;
and the two hand-offs the task graph adds: from a receive's completion to the next compute step's
start, and from an encode's end to the next send's post."""
import bisect, io, json, statistics, tarfile, os
here = os.path.dirname(os.path.abspath(__file__))
archive = tarfile.open(os.path.join(here, "timeline-h100.tar.gz"))

def measure(events):
    waits = sorted((e for e in events if e.get("name") == "wait"), key=lambda e: e["ts"])
    lo, hi = waits[1]["ts"] + waits[1]["dur"], waits[-1]["ts"] + waits[-1]["dur"]
    inside = lambda t: lo <= t <= hi
    compute = sorted((e for e in events if e.get("ph") == "X" and e["name"] in ("encode", "decode", "average")
                      and inside(e["ts"])), key=lambda e: e["ts"])
    spans = {}
    for e in events:
        if e.get("ph") in ("b", "e"):
            spans.setdefault((e["name"], e["id"]), {})[e["ph"]] = e["ts"]
    transfers = lambda kind: [(s["b"], s["e"]) for (name, _), s in spans.items()
                              if name.startswith(kind) and len(s) == 2 and inside(s["b"])]
    sends, recvs = transfers("send"), transfers("recv")
    starts = [c["ts"] for c in compute]
    posts = sorted(b for b, _ in sends)
    after = lambda times, t: times[k] - t if (k := bisect.bisect_left(times, t)) < len(times) else None
    to_compute = [d for _, e in recvs if (d := after(starts, e)) is not None]
    to_send = [d for c in compute if c["name"] == "encode" if (d := after(posts, c["ts"] + c["dur"])) is not None]
    iterations = len(waits) - 2
    return {"synchronization (ms)": (hi - lo) / iterations / 1e3,
            "compute busy (ms)": sum(c["dur"] for c in compute) / iterations / 1e3,
            "send (us)": statistics.median(e - b for b, e in sends),
            "recv (us)": statistics.median(e - b for b, e in recvs),
            "recv done -> compute (us)": statistics.median(to_compute),
            "encode done -> send (us)": statistics.median(to_send)}

rows = {}
for run in ("contexts-serial", "contexts-task-graph", "mps-serial", "mps-task-graph"):
    ranks = [measure(json.load(archive.extractfile(f"timeline-h100/{run}.{r}.json"))["traceEvents"]) for r in range(4)]
    rows[run] = {k: statistics.mean(m[k] for m in ranks) for k in ranks[0]}
keys = list(next(iter(rows.values())))
print("| run | " + " | ".join(keys) + " |")
print("|" + "---|" * (len(keys) + 1))
for run, m in rows.items():
    print(f"| {run} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
