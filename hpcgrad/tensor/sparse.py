"""Row-sparse gradients (``Embedding(sparse=True)``): a few rows of a large tensor, as indices + values."""

import numpy as np

from hpcgrad.base import backend


class SparseCOOTensor:
    """Rows ``indices`` of a tensor of ``shape`` hold ``values``; every other row is zero.

    Indices may repeat until ``coalesce()`` sums them. This is a gradient type only: it flows
    through the engine into ``.grad``, optimizers apply it row by row, and the DDP reducer
    all-gathers it. Use ``to_dense()`` for anything else.
    """

    is_sparse = True
    requires_grad = False
    grad_fn = None
    array = data = None  # not a dense array: the engine's fast checks see it and take the full path

    def __init__(self, indices, values, shape):
        xp = backend.get_array_module(values)
        self.indices = xp.asarray(indices, dtype=np.int64).reshape(-1)
        self.values = values
        self.shape = tuple(shape)
        if values.shape != (self.indices.shape[0],) + self.shape[1:]:
            raise ValueError(f"SparseCOOTensor: values of shape {list(values.shape)} do not match "
                             f"{self.indices.shape[0]} indices of rows of shape "
                             f"{list(self.shape[1:])}")

    dtype = property(lambda self: self.values.dtype)
    device = property(lambda self: backend.device_of(self.values))
    ndim = property(lambda self: len(self.shape))

    def __repr__(self):
        return (f"SparseCOOTensor(shape={list(self.shape)}, nnz={self.indices.shape[0]}, "
                f"dtype={self.dtype})")

    def to_dense(self):
        """The full tensor, as an hpcgrad Tensor."""
        from hpcgrad.tensor._tensor import Tensor
        return Tensor._make(self.add_to(self._zeros()), False, None, 0)

    def _zeros(self):
        return backend.get_array_module(self.values).zeros(self.shape, self.values.dtype)

    def add_to(self, array):
        """Add the rows into ``array`` in place (repeated rows add up); returns ``array``."""
        if backend.is_gpu_array(array):
            import cupyx
            cupyx.scatter_add(array, self.indices, self.values)
        else:
            np.add.at(array, self.indices, self.values)
        return array

    def coalesce(self):
        """Sorted unique row indices, with the values of repeated rows summed."""
        xp = backend.get_array_module(self.values)
        unique, inverse = xp.unique(self.indices, return_inverse=True)
        values = xp.zeros((unique.shape[0],) + self.shape[1:], self.values.dtype)
        if xp is np:
            np.add.at(values, inverse.reshape(-1), self.values)
        else:
            import cupyx
            cupyx.scatter_add(values, inverse.reshape(-1), self.values)
        return SparseCOOTensor(unique, values, self.shape)

    def add_rows_(self, other):
        """Append ``other``'s rows (uncoalesced, as sparse + sparse): the sum, in this object."""
        if other.shape != self.shape:
            raise RuntimeError(f"cannot add sparse tensors of shapes {list(self.shape)} and "
                               f"{list(other.shape)}")
        xp = backend.get_array_module(self.values)
        self.indices = xp.concatenate([self.indices, other.indices])
        self.values = xp.concatenate([self.values, other.values])
        return self

    def detach_copy(self):
        return SparseCOOTensor(self.indices.copy(), self.values.copy(), self.shape)

    def to(self, dtype):
        return SparseCOOTensor(self.indices, self.values.astype(dtype), self.shape)

    def __mul__(self, scalar):
        if not isinstance(scalar, (int, float)):
            raise TypeError("a SparseCOOTensor can only be scaled by a Python number")
        return SparseCOOTensor(self.indices, self.values * scalar, self.shape)

    __rmul__ = __mul__

    def __truediv__(self, scalar):
        """``grad / world_size``, as PyTorch's sparse comm hook divides its all-reduced bucket."""
        if not isinstance(scalar, (int, float)):
            raise TypeError("a SparseCOOTensor can only be divided by a Python number")
        return SparseCOOTensor(self.indices, self.values / scalar, self.shape)

    def __add__(self, other):
        """sparse + sparse stays sparse (rows concatenated); sparse + dense is dense."""
        if isinstance(other, SparseCOOTensor):
            if other.shape != self.shape:
                raise RuntimeError(f"cannot add sparse tensors of shapes {list(self.shape)} and "
                                   f"{list(other.shape)}")
            xp = backend.get_array_module(self.values)
            return SparseCOOTensor(xp.concatenate([self.indices, other.indices]),
                                   xp.concatenate([self.values, other.values]), self.shape)
        from hpcgrad.tensor._tensor import Tensor
        if isinstance(other, Tensor):
            if other.shape != self.shape:
                raise RuntimeError(f"cannot add a sparse tensor of shape {list(self.shape)} to a "
                                   f"dense one of shape {list(other.shape)}")
            if other.requires_grad:
                return other + self.to_dense()
            return Tensor._make(self.add_to(other.array.copy()), False, None, 0)
        return NotImplemented

    __radd__ = __add__
