"""A rank that trains a small MLP with gradsync.torch.DistributedOptimizer on its share of each
batch, and writes the parameters it ends with (or the exception a misuse raised)."""
import json
import os
import signal
import sys

import torch

import gradsync.torch
from model import STEPS, data, make_model

result, dtype_name, bucketing, codec, case = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dtype = getattr(torch, dtype_name)
torch.set_num_threads(1)
model = make_model(dtype)
images, labels = data(dtype)
named = list(model.named_parameters())
if case == "unused":
    named.append(("unused", torch.nn.Parameter(torch.zeros(3, dtype=dtype))))  # no forward uses it
optimizer = gradsync.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), named,
                                                bucketing=bucketing, codec=codec, timeout=30)
rank, ranks = optimizer.synchronizer.rank, optimizer.synchronizer.size
share = images.shape[1] // ranks
try:
    for step in range(STEPS):
        optimizer.zero_grad()
        if case == "killed" and step == 2 and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "replaced-grad" and step == 1:
            model[0].bias.grad = torch.zeros_like(model[0].bias)
        mine = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.cross_entropy(model(images[step, mine]).float(), labels[step, mine]).backward()
        optimizer.step()
    with open(result, "w") as f:
        json.dump({"ok": True, "parameters": [p.detach().float().flatten().tolist() for p in model.parameters()]}, f)
except Exception as e:
    with open(result, "w") as f:
        json.dump({"ok": False, "type": type(e).__name__, "message": str(e)}, f)
