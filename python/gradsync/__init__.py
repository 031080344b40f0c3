"""gradsync from Python: gradient synchronization for data-parallel training.

gradsync.Synchronizer averages registered gradients (torch tensors or numpy arrays on the CPU)
over the ranks of a job started by gradsync-run, torchrun, mpirun or srun, with the policies the
C++ library ships, picked by name. gradsync.torch adds a DistributedOptimizer for PyTorch.

    sync = gradsync.Synchronizer(bucketing="time-clustered", codec="ef-two-bit")
    gid = sync.add("fc.weight", grad)  # the buffer is averaged in place
    ...                                # backward: sync.ready(gid) once grad holds this step's value
    sync.wait()                        # grad now holds the average over the ranks
"""
from ._gradsync import Error, PeerFailed, Synchronizer, Timeout

__all__ = ["Error", "PeerFailed", "Synchronizer", "Timeout"]
