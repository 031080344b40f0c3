"""gradsync for PyTorch: DistributedOptimizer, the Horovod-style path without DDP.

Each parameter's .grad is registered with a gradsync.Synchronizer once, as a buffer of its own; a
hook on the parameter's gradient accumulator marks it ready as soon as backward has accumulated
into it, so its bucket leaves while backward goes on (time-clustered buckets learn those times);
step() waits for the averages and steps the wrapped optimizer.
"""
import torch

from ._gradsync import Synchronizer


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
