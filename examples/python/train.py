#!/usr/bin/python3
"""Fashion-MNIST, data-parallel from Python, five ways with the same model, data, seed and settings.

    train.py --mode {ddp,ddp-fp16,ddp-powersgd,hook,optimizer} [--codec C] [--bucketing B]
             [--epochs N] [--batch B] [--json PATH]

  ddp            DistributedDataParallel over gloo, its own allreduce
  ddp-fp16       DDP with PyTorch's fp16 compression hook
  ddp-powersgd   DDP with PyTorch's PowerSGD hook (rank --powersgd-rank, from the first step)
  hook           DDP with gradsync's hook (gradsync.torch.allreduce_hook, --codec)
  optimizer      gradsync.torch.DistributedOptimizer, no DDP (--bucketing, --codec)

The model is examples/fmnist's: a 784-256-128-10 MLP, SGD with momentum, each rank training on its
share of every global batch of --batch samples a rank. Start it under gradsync-run or netcluster
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the optimizer mode also GRADSYNC_TOKEN, and its
gradsync rendezvous takes MASTER_PORT itself) or, for the DDP modes, torchrun. Rank 0 prints each
epoch and writes the JSON (results/session.sh: how the figures in results/ were made).
"""
import argparse
import fcntl
import gzip
import json
import os
import socket
import statistics
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradsync.torch


def load(directory, kind):
    with gzip.open(os.path.join(directory, f"{kind}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784).astype(np.float32) / 255.0
    with gzip.open(os.path.join(directory, f"{kind}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)
    return torch.from_numpy(images), torch.from_numpy(labels)


def choose_gloo_interface():
    """Points gloo at the interface this machine reaches MASTER_ADDR through, unless
    GLOO_SOCKET_IFNAME says which: gloo otherwise takes the address its host name resolves to,
    which on emulated hosts (netcluster) is loopback, where the other ranks are not."""
    if "GLOO_SOCKET_IFNAME" in os.environ or "MASTER_ADDR" not in os.environ:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet is sent: this only picks a route
        local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            if address == local:
                os.environ["GLOO_SOCKET_IFNAME"] = name
                return


def model_for(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", required=True, choices=["ddp", "ddp-fp16", "ddp-powersgd", "hook", "optimizer"])
    parser.add_argument("--codec", default="none", help="gradsync's codec (hook, optimizer)")
    parser.add_argument("--bucketing", default="time-clustered", help="gradsync's bucketing (optimizer)")
    parser.add_argument("--threshold", type=float, default=0.1,
                        help="two-bit's threshold (examples/fmnist's for this model; the library's 0.5 is MXNet's)")
    parser.add_argument("--powersgd-rank", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16, help="samples a rank and step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--json", default="")
    o = parser.parse_args()
    torch.set_num_threads(1)

    uses_ddp = o.mode != "optimizer"
    if uses_ddp:
        choose_gloo_interface()
        dist.init_process_group("gloo")
    model = model_for(o.seed)
    train = model
    if uses_ddp:
        train = DistributedDataParallel(model)
        if o.mode == "ddp-fp16":
            train.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif o.mode == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=o.powersgd_rank,
                                                start_powerSGD_iter=2, random_seed=o.seed)
            train.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif o.mode == "hook":
            train.register_comm_hook(gradsync.torch.HookState(codec=o.codec, threshold=o.threshold),
                                     gradsync.torch.allreduce_hook)
        rank, ranks = dist.get_rank(), dist.get_world_size()
        optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    else:
        optimizer = gradsync.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum), model.named_parameters(),
            bucketing=o.bucketing, codec=o.codec, threshold=o.threshold)
        rank, ranks = optimizer.synchronizer.rank, optimizer.synchronizer.size

    images, labels = load(o.data, "train")
    test_images, test_labels = load(o.data, "t10k")
    global_batch = o.batch * ranks
    steps = len(images) // global_batch
    generator = torch.Generator().manual_seed(o.seed)
    epochs = []
    for epoch in range(1, o.epochs + 1):
        order = torch.randperm(len(images), generator=generator)
        step_seconds, losses = [], []
        started = time.perf_counter()
        for step in range(steps):
            begin = time.perf_counter()
            mine = order[step * global_batch + rank * o.batch: step * global_batch + (rank + 1) * o.batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(train(images[mine]), labels[mine])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step_seconds.append(time.perf_counter() - begin)
        seconds = time.perf_counter() - started
        with torch.no_grad():
            accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
        report = {"epoch": epoch, "steps": steps, "seconds": round(seconds, 3),
                  "samples_per_second": round(steps * global_batch / seconds, 1),
                  "median_step_seconds": round(statistics.median(step_seconds), 6),
                  "loss": round(statistics.fmean(losses[-steps // 10:]), 5), "test_accuracy": round(accuracy, 4)}
        epochs.append(report)
        if rank == 0:
            print(f"epoch {epoch}: {o.mode} codec {o.codec}: test accuracy {accuracy:.4f} | {seconds:.1f} s, "
                  f"{report['samples_per_second']:.0f} samples/s, median step {1e3 * report['median_step_seconds']:.2f} ms",
                  flush=True)
    if rank == 0 and o.json:
        with open(o.json, "w") as f:
            json.dump({"mode": o.mode, "codec": o.codec if o.mode in ("hook", "optimizer") else None,
                       "bucketing": o.bucketing if o.mode == "optimizer" else None, "threshold": o.threshold,
                       "powersgd_rank": o.powersgd_rank if o.mode == "ddp-powersgd" else None, "ranks": ranks,
                       "batch_per_rank": o.batch, "learning_rate": o.lr, "momentum": o.momentum, "seed": o.seed,
                       "torch": torch.__version__, "epochs": epochs}, f, indent=1)
    if uses_ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
