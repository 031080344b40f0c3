"""Runs a job's ranks as processes of this machine, as a launcher would (gradsync-run, torchrun):
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and a job token. Each
rank runs a script of workers/ with the interpreter running the tests and writes what it found to
a JSON file of its own, which the test reads."""
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def _make_importable():
    """Lets `python3 -m pytest python/tests` run from a checkout without PYTHONPATH: the module from
    a build directory of it (build*/python), and Debian's packages (torch, numpy) where the
    interpreter running the tests is another CPython 3.11 than Debian's (pyenv's first on PATH).
    The ranks' processes inherit the same path through PYTHONPATH."""
    extra = []
    try:
        import gradsync  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        built = sorted(p for p in root.glob("build*/python") if any((p / "gradsync").glob("_gradsync*.so")))
        extra += [str(p) for p in built[:1]]
    debian = Path("/usr/lib/python3/dist-packages")
    if sys.version_info[:2] == (3, 11) and debian.is_dir() and str(debian) not in sys.path:
        try:
            import torch  # noqa: F401
        except ImportError:
            extra.append(str(debian))
    if extra:
        sys.path[0:0] = [p for p in extra if p != str(debian)]
        if str(debian) in extra:
            sys.path.append(str(debian))
        os.environ["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [os.environ.get("PYTHONPATH")] if p])


_make_importable()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, directory):
        self.directory = Path(directory)

    def run(self, script, ranks, *args, machines=1, timeout=120, env=None):
        """Runs workers/<script> as `ranks` ranks (machines of ranks / machines each, shared memory
        within one, TCP loopback between them); returns each rank's JSON result, None for a rank that
        wrote none, and each rank's exit status."""
        port, token = free_port(), secrets.token_hex(16)
        per_machine = ranks // machines
        processes = []
        for rank in range(ranks):
            result = self.directory / f"rank{rank}.json"
            result.unlink(missing_ok=True)
            rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank % per_machine),
                            LOCAL_WORLD_SIZE=str(per_machine), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            GRADSYNC_TOKEN=token,
                            **(env or {}))
            processes.append(subprocess.Popen([sys.executable, str(WORKERS / script), str(result), *map(str, args)],
                                              env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
        outputs, statuses = [], []
        for p in processes:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append(out)
            statuses.append(p.returncode)
        results = []
        for rank in range(ranks):
            path = self.directory / f"rank{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        self.outputs = outputs
        return results, statuses


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path)
