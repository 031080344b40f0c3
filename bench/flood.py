#!/usr/bin/env python3
"""A stranger flooding a gradsync job's setup port: keeps CONNECTIONS connections open to HOST:PORT,
half of them silent, half sending 36 bytes of garbage where a hello belongs, and opens a new one
whenever one is closed, until killed (SIGTERM). Prints how many it opened, every 5 s and at the end.
Usage: flood.py HOST PORT [CONNECTIONS]"""
import selectors, signal, socket, sys, time

host, port = sys.argv[1], int(sys.argv[2])
target = int(sys.argv[3]) if len(sys.argv) > 3 else 200
selector = selectors.DefaultSelector()
opened = 0

def open_one():
    global opened
    s = socket.socket()
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        time.sleep(0.01)  # not listening (yet, or any more)
        return
    opened += 1
    if opened % 2:
        s.sendall(b"\xde\xad\xbe\xef" + bytes(32))
    selector.register(s, selectors.EVENT_READ)

def report(*_):
    print(f"flood: {opened} connections opened", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, report)
last = time.monotonic()
while True:
    while len(selector.get_map()) < target:
        open_one()
    for key, _ in selector.select(timeout=0.1):
        try:
            data = key.fileobj.recv(4096)
        except OSError:
            data = b""
        if not data:  # closed by the job: replace it
            selector.unregister(key.fileobj)
            key.fileobj.close()
    if time.monotonic() - last > 5:
        print(f"flood: {opened} connections opened", flush=True)
        last = time.monotonic()
