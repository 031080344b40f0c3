#!/usr/bin/env python3
"""Tabulates session.sh's JSON: per shape, configuration and size, the median over rounds of each
run's time (itself a median of 5 iterations), and the ratios the issue asks about."""
import glob
import json
import os
import re
import statistics
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
times = {}  # (shape, config) -> {bytes: [time_us per round]}
for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    m = re.match(r"(\dx\d)-(.*)-(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    shape, config, _ = m.groups()
    for row in json.load(open(path)):
        times.setdefault((shape, config), {}).setdefault(row["bytes"], []).append(row["time_us"])

median = {k: {b: statistics.median(v) for b, v in sizes.items()} for k, sizes in times.items()}
for shape in sorted({s for s, _ in median}):
    print(f"{shape} at 1 Gbit/s: median over rounds of each run's median time (ms); rounds per cell")
    configs = sorted(c for s, c in median if s == shape)
    for config in configs:
        cells = "  ".join(f"{b >> 20:>3} MiB {median[(shape, config)][b] / 1e3:9.2f} ms ({len(times[(shape, config)][b])})"
                          for b in sorted(median[(shape, config)]))
        print(f"  {config:<28} {cells}")
    def ratio(a, b, size):
        if (shape, a) in median and (shape, b) in median and size in median[(shape, a)] and size in median[(shape, b)]:
            return median[(shape, b)][size] / median[(shape, a)][size]
        return None
    for size in sorted(median.get((shape, "mpi-none"), {})):
        parts = []
        for a, b, what in [("mpi-none", "tcp-none", "Tcp/Mpi none"), ("mpi-ef-two-bit", "tcp-ef-two-bit", "Tcp/Mpi ef-two-bit"),
                           ("mpi-ef-two-bit", "mpi-allreduce-tuned", "MPI_Allreduce tuned / Mpi ef-two-bit"),
                           ("mpi-ef-two-bit", "mpi-allreduce-han", "MPI_Allreduce HAN / Mpi ef-two-bit"),
                           ("mpi-none", "mpi-allreduce-tuned", "MPI_Allreduce tuned / Mpi none"),
                           ("mpi-none", "mpi-allreduce-han", "MPI_Allreduce HAN / Mpi none")]:
            r = ratio(a, b, size)
            if r is not None:
                parts.append(f"{what} {r:.3f}x")
        print(f"  {size >> 20} MiB: " + "; ".join(parts))
    print()
