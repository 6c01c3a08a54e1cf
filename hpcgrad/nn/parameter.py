"""Parameter: a leaf Tensor that a Module registers as learnable (requires_grad=True by default)."""

import numpy as np

from hpcgrad.tensor._tensor import Tensor


class Parameter(Tensor):
    """A Tensor that, assigned as a Module attribute, joins the Module's ``parameters()``.

    It shares memory with ``data`` (an array or a Tensor) and is always a leaf, as in PyTorch.
    """

    __slots__ = ()

    def __init__(self, data=None, requires_grad=True):
        if data is None:
            data = np.empty(0, dtype=np.float32)
        super().__init__(data, requires_grad=requires_grad)

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()

    def __deepcopy__(self, memo):
        # Tensor's weak reference to its grad accumulator cannot be copied: start without one.
        if id(self) in memo:
            return memo[id(self)]
        result = Parameter(self.array.copy(), self.requires_grad)
        if self.grad is not None:
            result.grad = self.grad.detach_copy()
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, protocol):
        return Parameter, (self.array, self.requires_grad)
