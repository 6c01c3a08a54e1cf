"""Activation checkpointing: drop a block's activations in forward, recompute them in backward.

The recompute runs a nested backward from inside the outer one (a reentrant backward; see
Note [Reentrant backwards] in hpcgrad/autograd/engine.py), as PyTorch's reentrant checkpoint does.
"""

from .. import creation
from ..autograd import Function, backward, enable_grad, no_grad
from ..autograd.engine import Engine
from ..tensor import Tensor


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


def checkpoint(function, *args, preserve_rng_state=True):
    """``function(*args)`` without keeping its activations; they are recomputed in backward.

    Trades compute for memory. The recompute sees the same random numbers (dropout) as the
    forward unless ``preserve_rng_state=False``. Not usable with ``autograd.grad`` or
    ``backward(inputs=...)`` (as in PyTorch's reentrant checkpoint).
    """
    return CheckpointFunction.apply(function, preserve_rng_state, *args)
