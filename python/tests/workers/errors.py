"""Misuse and failures, one per run, reported as the exception's class and message."""
import json
import os
import sys
import threading
import time

import numpy as np

import gradsync

result, case = sys.argv[1], sys.argv[2]


def report(**fields):
    with open(result, "w") as f:
        json.dump(fields, f)


try:
    if case == "never-ready":
        sync = gradsync.Synchronizer(timeout=30)
        a, b = np.zeros(8, dtype=np.float32), np.zeros(8, dtype=np.float32)
        sync.add("a", a)
        sync.add("b", b)
        sync.ready("a")
        sync.wait()
    elif case == "dead-peer":
        # Rank 1 dies after registering; rank 0 waits for it.
        sync = gradsync.Synchronizer(timeout=60)
        a = np.zeros(1000, dtype=np.float32)
        sync.add("a", a)
        if sync.rank == 1:
            os._exit(3)
        sync.ready("a")
        sync.wait()
    elif case == "gil":
        # Rank 1 marks its gradient ready only once a second thread of rank 0 has run while rank 0
        # is blocked in wait() (it sleeps first, so that the main thread is in there): were the
        # GIL held in wait(), that thread could not run, and rank 0's wait would time out.
        signal = os.path.join(os.path.dirname(result), "rank0-thread-ran")
        sync = gradsync.Synchronizer(timeout=20)
        a = np.ones(1000, dtype=np.float32)
        sync.add("a", a)
        if sync.rank == 1:
            while not os.path.exists(signal):
                time.sleep(0.01)
            sync.ready("a")
            sync.wait()
        else:
            def run_during_wait():
                time.sleep(0.5)
                open(signal, "w").close()

            thread = threading.Thread(target=run_during_wait)
            thread.start()
            sync.ready("a")
            sync.wait()
            thread.join()
    report(ok=True)
except Exception as e:  # what the test looks at
    report(ok=False, type=type(e).__name__, bases=[b.__name__ for b in type(e).__mro__], message=str(e))
