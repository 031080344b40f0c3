"""A rank that averages gradient-like numpy arrays (f32 and f64, N(0, 0.01), different per rank)
for a few steps with the policies named on the command line, and writes what wait() left."""
import json
import sys

import numpy as np

import gradsync

result, bucketing, codec, topology, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sync = gradsync.Synchronizer(bucketing=bucketing, codec=codec, topology=topology, timeout=60)
rank = sync.rank
weight = np.zeros((64, 33), dtype=np.float32)
bias = np.zeros(33, dtype=np.float32)
extra = np.zeros(17, dtype=np.float64)
ids = [sync.add("weight", weight), sync.add("bias", bias), sync.add("extra", extra)]
left = []
for step in range(steps):
    generator = np.random.default_rng(1000 * step + rank)
    for array in (weight, bias, extra):
        array[...] = generator.normal(0.0, 0.01, array.shape)
    for gradient_id in reversed(ids):  # backward's order
        sync.ready(gradient_id)
    sync.wait()
    left.append([weight.ravel().tolist(), bias.tolist(), extra.tolist()])
with open(result, "w") as f:
    json.dump({"rank": rank, "size": sync.size, "left": left, "plan": sync.plan}, f)
