#!/usr/bin/env python3
"""Turns bench/results JSON into the PNGs bench/README.md shows (bench/plots/). Every point is a
number a benchmark program wrote; nothing is typed in here. Needs matplotlib (python3-matplotlib).

  bench/plot.py [RESULTS_DIR] [OUT_DIR]      (defaults: bench/results, bench/plots)

- busbw.png: bus bandwidth against message size, ring allreduce of 4 ranks, per transport
  (bench/allreduce's JSON: in-process threads, TCP over loopback, TCP on 4 emulated hosts at 1 Gbit/s).
- codecs.png: each codec's CPU encode and decode speed, and its compression ratio (bench/codecs).
- replay.png: iteration time against the communication left exposed, per bucketing policy, for
  the ResNet-50 and BERT-base traces, two runs each (bench/replay).
"""
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

results = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
out = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "bench/plots")
out.mkdir(parents=True, exist_ok=True)


def load(name):
    return json.loads((results / name).read_text())


def busbw():
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, label in [("in-process-4.json", "in-process (threads)"),
                        ("tcp-loopback-4.json", "TCP, loopback"),
                        ("netcluster-4x1gbit-cubic.json", "TCP, 4 emulated hosts at 1 Gbit/s")]:
        rows = [r for r in load(name) if r["codec"] == "none" and r["topology"] == "ring"]
        ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("ring allreduce, 4 ranks, f32, no compression (bench/allreduce)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "busbw.png", dpi=110)


def codecs():
    rows = [r for r in load("codecs-cpu.json") if r["device"] == "cpu"]
    names = [r["codec"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["encode_GBps"] for r in rows], width, label="encode")
    ax.bar([i + width / 2 for i in x], [r["decode_GBps"] for r in rows], width, label="decode")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['ratio']:.0f}x", (i, max(r["encode_GBps"], r["decode_GBps"])), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("GB/s of f32 input")
    ax.set_title(f"codecs on the CPU, {rows[0]['bytes'] >> 20} MiB, compression ratio on top (bench/codecs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "codecs.png", dpi=110)


def replay():
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, model in zip(axes, ["resnet50", "bert-base"]):
        policies = {}
        for run in ("run1", "run2"):
            for path in sorted((results / "replay" / run).glob(f"{model}-*.json")):
                d = json.loads(path.read_text())
                if d.get("drift_at", -1) >= 0:
                    continue  # the drift experiment is a different question
                label = path.stem[len(model) + 1:]
                policies.setdefault(label, []).append(d)
        for label, runs in sorted(policies.items()):
            ax.scatter([d["exposed_ms"] for d in runs], [d["iteration_ms"] for d in runs], label=label, s=25)
        ax.set_xlabel("exposed communication (ms, median)")
        ax.set_ylabel("iteration (ms, median)")
        ax.set_title(f"{model}, 4 ranks over TCP (bench/replay)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replay.png", dpi=110)


busbw()
codecs()
replay()
print(f"wrote {', '.join(str(p) for p in sorted(out.glob('*.png')))}")
