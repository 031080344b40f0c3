#!/usr/bin/env python3
"""Tabulates session.sh's JSON: per configuration, the median over the rounds of the median step
time and of samples per second, their ratios to DDP's own allreduce, and each round's accuracy."""
import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
configurations = ["ddp", "ddp-fp16", "ddp-powersgd", "hook-none", "hook-ef-two-bit", "optimizer-ef-two-bit"]
rows = {}
for name in configurations:
    runs = [json.load(open(f))["epochs"][0] for f in sorted(glob.glob(os.path.join(here, f"{name}-[0-9].json")))]
    if runs:
        rows[name] = runs
base = statistics.median(r["median_step_seconds"] for r in rows["ddp"])
powersgd = statistics.median(r["median_step_seconds"] for r in rows["ddp-powersgd"])
print(f"{'configuration':22s} {'rounds':>6s} {'step ms':>8s} {'samples/s':>10s} {'vs ddp':>7s} {'vs powersgd':>11s}  accuracy")
for name, runs in rows.items():
    step = statistics.median(r["median_step_seconds"] for r in runs)
    rate = statistics.median(r["samples_per_second"] for r in runs)
    accuracy = ", ".join(f"{r['test_accuracy']:.4f}" for r in runs)
    print(f"{name:22s} {len(runs):6d} {1e3 * step:8.2f} {rate:10.1f} {base / step:6.2f}x {powersgd / step:10.2f}x  {accuracy}")
