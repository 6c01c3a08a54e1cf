"""Activation checkpointing: drop a block's activations in forward, recompute them in backward.

Two ways, as PyTorch's: the reentrant one runs a nested backward through the recomputed block
from inside the outer one (Note [Reentrant backwards] in hpcgrad/autograd/engine.py); the
non-reentrant one (``use_reentrant=False``) keeps the block's graph but replaces what it saves by
placeholders (saved-tensor hooks) and recomputes the values when backward first needs one, so it
also works with ``autograd.grad`` and ``backward(inputs=...)``.
"""

import warnings

from .. import creation
from ..autograd import Function, backward, enable_grad, no_grad
from ..autograd.engine import Engine
from ..autograd.saved_hooks import saved_tensors_hooks
from ..tensor import Tensor


class CheckpointError(RuntimeError):
    """The recomputation did not save what the forward saved (the block is not deterministic)."""


class CheckpointFunction(Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        if not any(isinstance(a, Tensor) and a.requires_grad for a in args):
            raise ValueError("checkpoint: none of the inputs requires grad, so there would be "
                             "nothing to recompute; call the function directly")
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


def checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True, **kwargs):
    """``function(*args, **kwargs)`` without keeping its activations; recomputed in backward.

    Trades compute for memory. The recompute sees the same random numbers (dropout) as the
    forward unless ``preserve_rng_state=False``. ``use_reentrant=True`` (the default here) is not
    usable with ``autograd.grad`` or ``backward(inputs=...)`` and takes no keyword arguments for
    ``function``; ``use_reentrant=False`` has neither limit (PyTorch recommends it).
    """
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


class _Frame:
    """One non-reentrant checkpointed call: how to recompute it, and what the recompute saved."""

    def __init__(self, function, args, kwargs, rng_state):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.rng_state = rng_state
        self.saved_count = 0    # tensors the forward saved (placeholders handed out)
        self.recomputed = {}    # placeholder index -> the recomputed (detached) tensor

    def pack(self, tensor):
        index = self.saved_count
        self.saved_count += 1
        return index  # the tensor itself is dropped: that is the memory saved

    def unpack(self, index):
        if index not in self.recomputed:
            self.recompute()
        # pop: each value is freed once its Node has read it; a second backward recomputes.
        return self.recomputed.pop(index)

    def recompute(self):
        values = []

        def keep(tensor):
            values.append(tensor.detach() if tensor.requires_grad else tensor)
            return None

        generator = creation.default_generator()
        outer_state = generator.bit_generator.state
        if self.rng_state is not None:
            generator.bit_generator.state = self.rng_state  # same dropout masks as in forward
        try:
            with enable_grad(), saved_tensors_hooks(keep, lambda _: None):
                self.function(*self.args, **self.kwargs)
        finally:
            generator.bit_generator.state = outer_state
        if len(values) != self.saved_count:
            raise CheckpointError(
                "checkpoint(use_reentrant=False): a different number of tensors was "
                f"saved during the original forward ({self.saved_count}) and the recomputation "
                f"({len(values)}); the checkpointed function must run the same ops each time")
        self.recomputed = dict(enumerate(values))


def _checkpoint_without_reentrant(function, preserve_rng_state, args, kwargs):
    rng_state = creation.default_generator().bit_generator.state if preserve_rng_state else None
    frame = _Frame(function, args, kwargs, rng_state)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args, **kwargs)
