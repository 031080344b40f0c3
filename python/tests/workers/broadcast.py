"""A rank whose model starts from its own seed; after broadcast_parameters every rank holds rank 0's."""
import json
import sys

import torch

import gradsync.torch
from model import make_model

result = sys.argv[1]
rank = int(__import__("os").environ["RANK"])
model = make_model()
with torch.no_grad():
    for p in model.parameters():
        p.add_(rank)  # every rank different
model[0].bias.data = model[0].bias.data.to(torch.float64)  # a float64 tensor among them
gradsync.torch.broadcast_parameters(model.named_parameters(), root_rank=0)
with open(result, "w") as f:
    json.dump({"parameters": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
