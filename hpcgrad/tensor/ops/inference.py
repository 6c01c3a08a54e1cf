"""hpcgrad.inference_mode: PyTorch's inference mode, here as no_grad."""

import threading

from hpcgrad.autograd import grad_mode
from hpcgrad.tensor.ops.common import function, method

_state = threading.local()  # how many inference_mode(True) blocks this thread is in


class inference_mode(grad_mode._DecoratorContextManager):
    """``with inference_mode():`` / ``@inference_mode()`` / ``@inference_mode``: no graph is
    recorded inside, as ``no_grad``; ``inference_mode(False)`` changes nothing.

    hpcgrad does not mark the tensors made inside as inference tensors: PyTorch's errors when
    one is later used in autograd or modified in place are not reproduced, and
    ``is_inference()`` is False for them. Thread-local, as no_grad.
    """

    def __new__(cls, mode=True):
        if isinstance(mode, bool):
            return super().__new__(cls)
        return cls()(mode)  # @inference_mode without parentheses

    def __init__(self, mode=True):
        self.mode = mode
        self._inner = None

    def __enter__(self):
        if self.mode:
            self._inner = grad_mode.no_grad()
            self._inner.__enter__()
            _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc):
        if self._inner is not None:
            self._inner.__exit__(*exc)
            self._inner = None
            _state.depth -= 1
        return False

    def clone(self):
        return self.__class__(self.mode)


function(inference_mode)


@function
def is_inference_mode_enabled():
    """True inside an ``inference_mode()`` block (of this thread)."""
    return getattr(_state, "depth", 0) > 0


@method
def is_inference(self):
    """False: hpcgrad makes no inference tensors (see inference_mode)."""
    return False
