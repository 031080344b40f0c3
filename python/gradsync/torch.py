"""gradsync for PyTorch: a DDP communication hook, and DistributedOptimizer without DDP.

allreduce_hook, with a HookState, makes DistributedDataParallel average each of its buckets
through gradsync (the codecs with error feedback, the task graph, shared memory within a
machine): ddp_model.register_comm_hook(gradsync.torch.HookState(codec="ef-two-bit"),
gradsync.torch.allreduce_hook).

DistributedOptimizer is the Horovod-style path: each parameter's .grad is registered with a
gradsync.Synchronizer once, as a buffer of its own; a hook on the parameter's gradient accumulator
marks it ready as soon as backward has accumulated into it, so its bucket leaves while backward
goes on (time-clustered buckets learn those times); step() waits for the averages and steps the
wrapped optimizer.
"""
import os
import secrets
import socket

import torch
import torch.distributed as dist

from ._gradsync import Synchronizer


def broadcast_parameters(named_parameters, root_rank=0, **policies):
    """Makes every rank's parameters (and buffers, any tensors given by name) root_rank's, bit for
    bit: the start of training without DDP, which broadcasts them itself. Each tensor travels as
    float64 in an average where the other ranks contribute zeros (the sum is exact, and scaling the
    average back by the number of ranks is exact after rounding to the tensor's own dtype, which
    float16, bfloat16 and float32 values survive), through a Synchronizer of its own (policies:
    gradsync.Synchronizer's keywords; the codec is always none)."""
    named = [(name, tensor) for name, tensor in named_parameters]
    policies = dict(policies, codec="none")
    synchronizer = Synchronizer(**policies)
    mine = synchronizer.rank == root_rank
    staged = []
    for name, tensor in named:
        values = tensor.detach().to(torch.float64).contiguous() if mine else torch.zeros(tensor.shape, dtype=torch.float64)
        synchronizer.add(name, values)
        staged.append(values)
    for index in range(len(staged)):
        synchronizer.ready(index)
    synchronizer.wait()
    with torch.no_grad():
        for (_, tensor), values in zip(named, staged):
            tensor.copy_(values.mul_(synchronizer.size).to(tensor.dtype))
    del synchronizer


class DistributedOptimizer:
    """Wraps `optimizer` so that each step uses gradients averaged over the job's ranks.

    named_parameters: the model's named_parameters(), the same on every rank and in the same
    order (tied parameters are registered once). policies: gradsync.Synchronizer's keywords
    (bucketing, codec, topology, executor, threshold, keep, seed, timeout, timeline).

    Each step: zero_grad(), forward, backward, step(). zero_grad() zeroes the registered buffers
    in place; an optimizer or model that replaces a .grad (set_to_none) breaks the link, which the
    next backward reports by the parameter's name.
    """

    def __init__(self, optimizer, named_parameters, **policies):
        self.optimizer = optimizer
        self.synchronizer = Synchronizer(**policies)
        self._parameters = []
        # A hook lives as long as its accumulator node is referenced: keep them.
        self._accumulators = []
        seen = set()
        for name, parameter in named_parameters:
            if not parameter.requires_grad or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter, memory_format=torch.contiguous_format)
            gradient_id = self.synchronizer.add(name, parameter.grad)
            accumulator = parameter.expand_as(parameter).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._ready_hook(name, parameter, gradient_id))
            self._accumulators.append(accumulator)
            self._parameters.append(parameter)

    def _ready_hook(self, name, parameter, gradient_id):
        address = parameter.grad.data_ptr()
        synchronizer = self.synchronizer

        def ready(*_):
            if parameter.grad is None or parameter.grad.data_ptr() != address:
                raise RuntimeError(
                    f"parameter {name!r}: its .grad is no longer the buffer gradsync averages (replaced by "
                    f"zero_grad(set_to_none=True) or an assignment?); use DistributedOptimizer.zero_grad()")
            synchronizer.ready(gradient_id)

        return ready

    def zero_grad(self, set_to_none=False):
        """Zeroes every registered gradient in place (set_to_none is refused: the buffers stay)."""
        if set_to_none:
            raise ValueError("set_to_none=True would replace the buffers gradsync averages")
        for parameter in self._parameters:
            parameter.grad.zero_()

    def step(self, closure=None):
        """Waits until every gradient holds its average over the ranks, then steps the optimizer."""
        self.synchronizer.wait()
        return self.optimizer.step(closure)

    def __getattr__(self, name):  # param_groups, state_dict(), ... of the wrapped optimizer
        return getattr(self.optimizer, name)


class HookState:
    """The state of allreduce_hook for one DistributedDataParallel model.

    DDP settles its buckets in its first iterations (it rebuilds them in the order backward made
    its gradients ready). Until they have kept the same sizes for two iterations, the hook
    averages each bucket with the process group's own allreduce; then every rank builds one
    gradsync.Synchronizer whose gradients are DDP's bucket buffers, averaged in place. The ranks
    find each other through the process group's store (torchrun's): rank 0 puts a free port of its
    machine and a job token there, so nothing else needs configuring. policies:
    gradsync.Synchronizer's keywords (codec, bucketing, topology, executor, threshold, keep, seed,
    timeout, timeline); bucketing defaults to per-tensor, as each DDP bucket is one gradient here.
    """

    def __init__(self, process_group=None, **policies):
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError("HookState: a process group of some of the ranks is not supported (gradsync's ranks "
                             "meet at world rank 0's MASTER_ADDR); use the default group")
        self.process_group = process_group
        self.policies = dict(policies)
        self.policies.setdefault("bucketing", "per-tensor")
        self.synchronizer = None
        self._seen = []        # this iteration's buckets, as (size, dtype), in hook order
        self._previous = None  # the last iteration's
        self._buffers = []     # the bucket buffers the synchronizer averages, by bucket index
        self._pending = []     # this iteration's (buffer, future) not completed yet
        self._generation = 0

    def _rendezvous(self):
        """The launcher's variables for gradsync's transport, its port and token through the store."""
        group = self.process_group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        store = dist.distributed_c10d._get_default_store()
        key = f"gradsync/hook/{self._generation}"
        if rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            store.set(key, f"{port} {secrets.token_hex(16)}")
        port, token = store.get(key).decode().split()
        environment = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_PORT": port, "GRADSYNC_TOKEN": token,
                       "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            environment[name] = os.environ.get(name, "0" if name == "LOCAL_RANK" else "1")
        return environment

    def _end_iteration(self, buffers):
        layout = [(b.numel(), b.dtype) for b in buffers]
        if self.synchronizer is None and layout == self._previous:
            self.synchronizer = Synchronizer(environment=self._rendezvous(), **self.policies)
            self._generation += 1
            for index, buffer in enumerate(buffers):
                self.synchronizer.add(f"ddp bucket {index}", buffer)
            self._buffers = list(buffers)
        self._previous = layout
        self._seen = []


def allreduce_hook(state, bucket):
    """DDP communication hook: the bucket's average over the ranks, through gradsync (HookState)."""
    buffer = bucket.buffer()
    index = bucket.index()
    state._seen.append(buffer)
    if state.synchronizer is None:
        world = dist.get_world_size(state.process_group)
        future = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
        if bucket.is_last():
            state._end_iteration(state._seen)
        return future.then(lambda f: f.value()[0].div_(world))
    if index >= len(state._buffers) or state._buffers[index].data_ptr() != buffer.data_ptr():
        raise RuntimeError(f"DDP bucket {index} is no longer the buffer gradsync registered: DDP rebuilt its "
                           f"buckets after gradsync took them over")
    state.synchronizer.ready(index)
    future = torch.futures.Future()
    state._pending.append((buffer, future))
    if bucket.is_last():
        state.synchronizer.wait()  # the GIL released; the earlier buckets have been on their way
        for averaged, waiting in state._pending:
            waiting.set_result(averaged)
        state._pending = []
        state._seen = []
    return future
