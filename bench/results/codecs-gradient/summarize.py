#!/usr/bin/env python3
"""The table of bench/README.md's compressed allreduce on gradient data, from the JSON session.sh wrote."""
import glob, json, os, statistics
here = os.path.dirname(os.path.abspath(__file__))
codecs = ["none", "ef-two-bit", "ef-one-bit", "terngrad", "ef-top-k", "ef-random-k"]
times = {c: [json.load(open(f))[0]["time_us"] / 1e3 for f in sorted(glob.glob(f"{here}/{c}-[0-9].json"))] for c in codecs}
wrong = {c: [json.load(open(f))[0]["wrong"] for f in sorted(glob.glob(f"{here}/{c}-[0-9].json"))] for c in codecs}
none = statistics.median(times["none"])
print("| codec | ms per allreduce, rounds 1-3 | median | algbw (GB/s) | vs none | ranks differing |")
print("|-------|------------------------------|--------|--------------|---------|-----------------|")
for c in codecs:
    m = statistics.median(times[c])
    print(f"| {c} | {', '.join(f'{t:.1f}' for t in times[c])} | {m:.1f} | {64 * 2**20 / m / 1e6:.3f} | {none / m:.1f}x | {sum(wrong[c])} |")
