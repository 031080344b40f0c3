"""A rank that trains the small MLP under DistributedDataParallel (gloo), with DDP's own allreduce
or gradsync's communication hook (a layer of it unused, which DDP is told to look for), and writes
the parameters it ends with; with "killed", the last
rank is killed at step 4 (after gradsync has taken DDP's bucket over) and the others write what
they raised."""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsync.torch
from model import data, make_model

result, mode, codec, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
case = sys.argv[5] if len(sys.argv) > 5 else "unused"
killed = case == "killed"
# "rebuilt": DDP told not to look for unused parameters, so it rebuilds its buckets in backward's
# order after the first iteration (new buffers), which the hook must not take over before.
looks_for_unused = case == "unused"
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, ranks = dist.get_rank(), dist.get_world_size()
# A few buckets of this small model: DDP's size limits apply from the first iteration where it may
# find unused parameters (otherwise that one is a single bucket, and 1.13 kept it so here).
# (Not when a rank is killed: looking for unused parameters makes DDP allreduce a map of them over
# gloo every step, which would see the death first.)
dist._DEFAULT_FIRST_BUCKET_BYTES = 1024


class WithUnused(torch.nn.Module):
    """The MLP and a layer no forward uses: DDP marks its gradient ready itself (zeros)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


model = DistributedDataParallel(WithUnused() if looks_for_unused else make_model(), bucket_cap_mb=0.002,
                                find_unused_parameters=looks_for_unused)
state = None
if mode == "hook":
    state = gradsync.torch.HookState(codec=codec, timeout=30)
    model.register_comm_hook(state, gradsync.torch.allreduce_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
images, labels = data(steps=steps)
share = images.shape[1] // ranks
try:
    for step in range(steps):
        optimizer.zero_grad()
        if killed and step == 4 and rank == ranks - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        mine = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.cross_entropy(model(images[step, mine]), labels[step, mine]).backward()
        optimizer.step()
except RuntimeError as e:
    with open(result, "w") as f:
        json.dump({"raised": type(e).__name__, "message": str(e)}, f)
    os._exit(1)
with open(result, "w") as f:
    json.dump({"parameters": [p.detach().flatten().tolist() for p in model.parameters()],
               "gradsync_buckets": len(state._buffers) if state else 0}, f)
dist.destroy_process_group()
if rank == 0 and case == "rebuilt":
    assert model._get_ddp_logging_data().get("has_rebuilt_buckets") == 1, "DDP did not rebuild its buckets"
