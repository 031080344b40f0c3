"""A rank that trains the small MLP under DistributedDataParallel (gloo), with DDP's own allreduce
or gradsync's communication hook, and writes the parameters it ends with."""
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsync.torch
from model import data, make_model

result, mode, codec, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, ranks = dist.get_rank(), dist.get_world_size()
# A few buckets of this small model: DDP's size limits apply from the first iteration where it may
# find unused parameters (otherwise that one is a single bucket, and 1.13 kept it so here).
dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
model = DistributedDataParallel(make_model(), bucket_cap_mb=0.002, find_unused_parameters=True)
state = None
if mode == "hook":
    state = gradsync.torch.HookState(codec=codec, timeout=30)
    model.register_comm_hook(state, gradsync.torch.allreduce_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
images, labels = data(steps=steps)
share = images.shape[1] // ranks
for step in range(steps):
    optimizer.zero_grad()
    mine = slice(rank * share, (rank + 1) * share)
    torch.nn.functional.cross_entropy(model(images[step, mine]), labels[step, mine]).backward()
    optimizer.step()
with open(result, "w") as f:
    json.dump({"parameters": [p.detach().flatten().tolist() for p in model.parameters()],
               "gradsync_buckets": len(state._buffers) if state else 0}, f)
dist.destroy_process_group()
