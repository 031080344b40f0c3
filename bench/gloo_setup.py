#!/usr/bin/python3
"""torch.distributed's gloo setup, timed beside gradsync's (bench/setup) and Open MPI's init:

    tools/gradsync-run -n N /usr/bin/python3 bench/gloo_setup.py [--rounds R] [--json PATH]

Each rank times init_process_group("gloo") and a barrier, R times in a row (each group destroyed
before the next; round r's store on rank 0 at MASTER_ADDR, MASTER_PORT + r), as bench/setup times
gradsync's Tcp: the first round also waits for the slowest rank to start (importing torch on a
busy machine takes seconds), the later ones start together. Rank 0 prints the slowest rank's time
per round and the median, and can write them as JSON. Needs Debian's python3-torch, which belongs
to /usr/bin/python3."""

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="setups timed, one after the other")
    parser.add_argument("--json", help="also write the rounds as JSON to this file")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    slowest = []
    for round in range(args.rounds):
        started = time.monotonic()
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port + round}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(minutes=10))
        dist.barrier()
        elapsed = torch.tensor([(time.monotonic() - started) * 1e3], dtype=torch.float64)
        dist.reduce(elapsed, 0, op=dist.ReduceOp.MAX)
        dist.barrier()  # nobody tears down while another still reduces
        dist.destroy_process_group()
        slowest.append(elapsed.item())
        if rank == 0:
            print(f"round {round + 1:3d}: slowest rank {slowest[-1]:10.1f} ms", flush=True)
    if rank == 0:
        median = statistics.median(slowest)
        print(f"gloo init+barrier {world} ranks: median over {args.rounds} rounds {median:.1f} ms (slowest rank)",
              flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"program": "gloo_setup", "torch": torch.__version__, "ranks": world,
                           "rounds_slowest_ms": slowest, "median_slowest_ms": median}, out, indent=1)

if __name__ == "__main__":
    main()
