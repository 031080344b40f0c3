#!/usr/bin/python3
"""The LibTorch trainer's model and training, with PyTorch's own DistributedDataParallel (gloo) in
place of gradsync: the peer libtorch-fmnist is compared with. One process per rank, placed by the
launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: netcluster run, torchrun).

  netcluster run 4 /usr/bin/python3 examples/libtorch/ddp.py --json ddp.json

The same network (model.hpp), data, batch per rank, learning rate, momentum and threads per rank as
libtorch-fmnist; every rank walks the same shuffled order and takes its shard of each global batch,
as there (the permutation is numpy's, not fmnist::epoch_order's). DDP's defaults otherwise: 25 MB
buckets after a 1 MB first one, gloo over TCP. --hook fp16 compresses with DDP's fp16 hook.
Needs Debian's python3-torch (run it with /usr/bin/python3)."""
import argparse
import gzip
import json
import os
import pathlib
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.first = nn.Conv2d(channels, channels, 3, padding=1)
        self.second = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.second(F.relu(self.first(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.block1 = ResidualBlock(16)
        self.block2 = ResidualBlock(32)
        self.hidden = nn.Linear(32 * 7 * 7, 128)
        self.out = nn.Linear(128, 10)

    def forward(self, x):
        h = self.block1(F.relu(self.stem(x)))
        h = self.block2(F.relu(self.down(F.max_pool2d(h, 2))))
        return self.out(F.relu(self.hidden(h.flatten(1))))


def read_idx(path):
    path = pathlib.Path(path)
    if not path.exists():
        path = path.with_name(path.name + ".gz")
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(directory, split):
    images = read_idx(f"{directory}/{split}-images-idx3-ubyte").astype(np.float32) / 255.0
    labels = read_idx(f"{directory}/{split}-labels-idx1-ubyte").astype(np.int64)
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=0, help="steps per epoch (0: the whole training set)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--hook", choices=["none", "fp16"], default="none")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    o = parser.parse_args()

    torch.set_num_threads(o.threads)
    # Gloo takes the address its host name resolves to (127.0.0.1 in a netcluster namespace) unless
    # told which interface; netcluster names each host's.
    if "NETCLUSTER_IFACE" in os.environ:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["NETCLUSTER_IFACE"])
    dist.init_process_group("gloo")  # env:// from the launcher's variables
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(o.seed)
    model = nn.parallel.DistributedDataParallel(Net())  # broadcasts rank 0's parameters
    if o.hook == "fp16":
        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    images, labels = load(o.data, "train")
    test_images, test_labels = load(o.data, "t10k")
    parameters = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"ddp: {world} ranks x batch {o.batch} | residual CNN ({parameters} parameters) | torch "
              f"{torch.__version__} gloo | hook {o.hook} | lr {o.lr} momentum {o.momentum}", flush=True)

    global_batch = o.batch * world
    steps = len(images) // global_batch
    if o.steps:
        steps = min(steps, o.steps)
    reports = []
    for epoch in range(1, o.epochs + 1):
        order = torch.from_numpy(np.random.default_rng([o.seed, epoch]).permutation(len(images)))
        step_seconds, loss_sum = [], 0.0
        start = time.perf_counter()
        for step in range(steps):
            began = time.perf_counter()
            mine = order[step * global_batch + rank * o.batch:step * global_batch + (rank + 1) * o.batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[mine]), labels[mine])
            loss.backward()  # DDP allreduces the buckets as autograd fills them
            optimizer.step()
            loss_sum += loss.item()
            step_seconds.append(time.perf_counter() - began)
            if rank == 0 and (step + 1) % max(1, steps // 10) == 0:
                print(f"epoch {epoch} {step + 1}/{steps} steps  loss {loss_sum / (step + 1):.4f}", flush=True)
        seconds = time.perf_counter() - start
        report = {"epoch": epoch, "steps": steps, "seconds": round(seconds, 3),
                  "step_seconds": round(seconds / steps, 5),
                  "median_step_seconds": round(float(np.median(step_seconds)), 5),
                  "samples_per_second": round(steps * global_batch / seconds, 1),
                  "loss": round(loss_sum / steps, 5), "test_accuracy": -1}
        if rank == 0:
            with torch.no_grad():
                predicted = torch.cat([model.module(test_images[i:i + 1000]).argmax(1)
                                       for i in range(0, len(test_images), 1000)])
            report["test_accuracy"] = round((predicted == test_labels).float().mean().item(), 4)
            print(f"epoch {epoch}: test accuracy {report['test_accuracy']:.4f} | {seconds:.1f} s, "
                  f"{report['samples_per_second']:.0f} samples/s, {1e3 * seconds / steps:.1f} ms a step", flush=True)
        reports.append(report)
    if rank == 0:
        print(f"done: {world} ranks, {o.epochs} epochs, test accuracy {reports[-1]['test_accuracy']:.4f}, "
              f"{reports[-1]['samples_per_second']:.0f} samples/s", flush=True)
        if o.json:
            pathlib.Path(o.json).write_text(json.dumps(
                {"program": "ddp", "torch": torch.__version__, "backend": "gloo", "hook": o.hook, "ranks": world,
                 "batch_per_rank": o.batch, "parameters": parameters, "threads": o.threads,
                 "learning_rate": o.lr, "momentum": o.momentum, "epochs": reports}, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
