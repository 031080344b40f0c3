#!/usr/bin/python3
"""torch.distributed's gloo setup, timed beside gradsync's (bench/setup) and Open MPI's init:

    tools/gradsync-run -n N /usr/bin/python3 bench/gloo_setup.py [--json PATH]

Each rank times init_process_group("gloo") and a barrier (the store on rank 0 at MASTER_ADDR:
MASTER_PORT, as gradsync-run and torchrun set them), from after `import torch`, which costs every
rank the same and is not setup. Rank 0 prints the slowest rank's time and can write it as JSON.
Needs Debian's python3-torch, which belongs to /usr/bin/python3."""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the result as JSON to this file")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    started = time.monotonic()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    dist.barrier()
    elapsed = torch.tensor([(time.monotonic() - started) * 1e3], dtype=torch.float64)
    dist.reduce(elapsed, 0, op=dist.ReduceOp.MAX)
    if rank == 0:
        slowest = elapsed.item()
        print(f"gloo init+barrier {world} ranks: {slowest:.1f} ms (slowest)", flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"program": "gloo_setup", "torch": torch.__version__, "ranks": world,
                           "slowest_ms": slowest}, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
