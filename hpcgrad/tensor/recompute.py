"""Activation checkpointing: drop a block's activations in forward, recompute them in backward.

Two ways, as PyTorch's: the reentrant one runs a nested backward through the recomputed block
from inside the outer one (Note [Reentrant backwards] in hpcgrad/autograd/engine.py); the
non-reentrant one (``use_reentrant=False``) keeps the block's graph but replaces what it saves by
placeholders (saved-tensor hooks) and recomputes the values when backward first needs one, so it
also works with ``autograd.grad`` and ``backward(inputs=...)``.
"""

import warnings

from hpcgrad.tensor import creation
from hpcgrad.autograd import Function, backward, enable_grad, no_grad
from hpcgrad.autograd.engine import Engine, current_graph_task
from hpcgrad.autograd.saved_hooks import saved_tensors_hooks
from hpcgrad.tensor._tensor import Tensor


class CheckpointError(RuntimeError):
    """The recomputation did not save what the forward saved (the block is not deterministic)."""


class CheckpointFunction(Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        ctx.run_function = run_function
        ctx.rng_state = creation.default_generator().bit_generator.state \
            if preserve_rng_state else None
        ctx.n_args = len(args)
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.others = [a for a in args if not isinstance(a, Tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        with no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not Engine.is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad() or when an `inputs` "
                               "parameter is passed to .backward(). Please use .backward() and do "
                               "not pass its `inputs` argument.")
        saved, others = iter(ctx.saved_tensors), iter(ctx.others)
        inputs = []
        for i in range(ctx.n_args):
            if i in ctx.tensor_positions:
                t = next(saved)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(next(others))
        generator = creation.default_generator()
        outer_state = generator.bit_generator.state
        if ctx.rng_state is not None:
            generator.bit_generator.state = ctx.rng_state  # same dropout masks as in forward
        try:
            with enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            generator.bit_generator.state = outer_state
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if not pairs:
            raise RuntimeError("checkpoint: none of the outputs has a gradient to pass back")
        backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if isinstance(x, Tensor) else None for x in inputs)


def checkpoint(function, *args, use_reentrant=None, preserve_rng_state=True, **kwargs):
    """``function(*args, **kwargs)`` without keeping its activations; recomputed in backward.

    Trades compute for memory. The recompute sees the same random numbers (dropout) as the
    forward unless ``preserve_rng_state=False``. Pass ``use_reentrant`` (PyTorch warns when it is
    left out, then uses True): True is not usable with ``autograd.grad`` or
    ``backward(inputs=...)`` and takes no keyword arguments for ``function``; False has neither
    limit (PyTorch recommends it).
    """
    if use_reentrant is None:
        warnings.warn("torch.utils.checkpoint: the use_reentrant parameter should be passed "
                      "explicitly. use_reentrant=False is recommended, but if you need to "
                      "preserve the current default behavior, you can pass use_reentrant=True.",
                      stacklevel=2)
        use_reentrant = True
    if not use_reentrant:
        return _checkpoint_without_reentrant(function, preserve_rng_state, args, kwargs)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs)
                         + " (the reentrant checkpoint passes only positional arguments; "
                         "use use_reentrant=False)")
    if not any(isinstance(a, Tensor) and a.requires_grad for a in args):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=2)
    return CheckpointFunction.apply(function, preserve_rng_state, *args)


class _StopRecomputation(Exception):
    """Raised inside a recompute once every saved tensor is back (PyTorch's early stop)."""


def _metadata(tensor):
    return tuple(tensor.shape), tensor.dtype, tensor.device


class _Frame:
    """One non-reentrant checkpointed call: how to recompute it, and what the recompute saved.

    Recomputed values are kept per backward (GraphTask) and each may be read once, as PyTorch's:
    a second backward (retain_graph) recomputes again.
    """

    def __init__(self, function, args, kwargs, rng_state):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.rng_state = rng_state
        self.saved = []       # (shape, dtype, device) of each tensor the forward saved
        self.recomputed = {}  # graph task id -> {index: recomputed (detached) tensor}
        self.unpacked = {}    # graph task id -> indices already handed out

    def pack(self, tensor):
        self.saved.append(_metadata(tensor))
        return len(self.saved) - 1  # the tensor itself is dropped: that is the memory saved

    def unpack(self, index):
        task = current_graph_task()
        key = None if task is None else task.id
        unpacked = self.unpacked.setdefault(key, set())
        if index in unpacked:
            raise CheckpointError(
                "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already "
                "unpacked once. If you are calling ctx.saved_tensors in backward, make sure to do "
                "so only once.")
        if key not in self.recomputed:
            self.recomputed = {key: self.recompute()}  # older backwards' values are done with
            self.unpacked = {key: unpacked}
        unpacked.add(index)
        # pop: each value is freed once its Node has read it.
        return self.recomputed[key].pop(index)

    def recompute(self):
        values = []
        wanted = len(self.saved)

        def keep(tensor):
            values.append(tensor.detach() if tensor.requires_grad else tensor)
            if len(values) == wanted:
                raise _StopRecomputation  # everything backward needs is back
            return None

        generator = creation.default_generator()
        outer_state = generator.bit_generator.state
        if self.rng_state is not None:
            generator.bit_generator.state = self.rng_state  # same dropout masks as in forward
        try:
            with enable_grad(), saved_tensors_hooks(keep, lambda _: None):
                self.function(*self.args, **self.kwargs)
        except _StopRecomputation:
            pass
        finally:
            generator.bit_generator.state = outer_state
        if len(values) != wanted:
            raise CheckpointError(
                "torch.utils.checkpoint: A different number of tensors was saved during the "
                f"original forward and recomputation.\nNumber of tensors saved during forward: "
                f"{wanted}\nNumber of tensors saved during recomputation: {len(values)}.\n"
                "The checkpointed function must run the same ops each time.")
        different = [f"tensor at position {i}:\nsaved metadata: {want}\nrecomputed metadata: "
                     f"{_metadata(got)}" for i, (want, got) in enumerate(zip(self.saved, values))
                     if _metadata(got) != want]
        if different:
            raise CheckpointError(
                "torch.utils.checkpoint: Recomputed values for the following tensors have "
                "different metadata than during the forward pass.\n" + "\n".join(different))
        return dict(enumerate(values))


def _checkpoint_without_reentrant(function, preserve_rng_state, args, kwargs):
    rng_state = creation.default_generator().bit_generator.state if preserve_rng_state else None
    frame = _Frame(function, args, kwargs, rng_state)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args, **kwargs)
