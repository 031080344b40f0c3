#!/usr/bin/env python3
"""What plain TCP achieves in a ring, for comparison with bench/allreduce over TCP.

Run once per host with the launcher variables set (netcluster run sets them):

    netcluster run 4 python3 bench/tcp_ring_baseline.py 384

Every rank streams MIB mebibytes to rank+1 over one socket while receiving as much from rank-1,
all at once, and prints the rate at which its own stream arrived. A ring allreduce of S bytes
moves 2(n-1)/n * S through every link, in dependent steps, so it can go no faster than the
slowest of these streams.
"""
import os
import socket
import sys
import threading
import time

PORT = 31000


def main():
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    prefix = os.environ.get("BASELINE_NET", "10.77.0")  # netcluster's addresses
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", PORT))
    listener.listen(1)
    received = {}

    def receive():
        conn, _ = listener.accept()
        buffer = bytearray(1 << 20)
        got = 0
        while got < mib << 20:
            k = conn.recv_into(buffer)
            if k == 0:
                break
            got += k
        received["at"] = time.time()

    reader = threading.Thread(target=receive)
    reader.start()
    out = socket.socket()
    while True:
        try:
            out.connect((f"{prefix}.{(rank + 1) % n + 1}", PORT))
            break
        except OSError:
            time.sleep(0.05)
    time.sleep(0.5)  # let every rank connect before anyone streams
    chunk = b"\0" * (1 << 20)
    start = time.time()
    for _ in range(mib):
        out.sendall(chunk)
    reader.join()
    seconds = received["at"] - start
    print(f"rank {rank}: {mib} MiB from rank {(rank - 1) % n} at {mib * 1.048576 / seconds:.1f} MB/s")


if __name__ == "__main__":
    main()
