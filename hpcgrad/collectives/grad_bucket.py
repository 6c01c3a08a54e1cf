"""GradBucket: what a DDP communication hook receives (torch.distributed.GradBucket)."""

from hpcgrad.tensor._tensor import Tensor


class GradBucket:
    """One bucket of gradients handed to a comm hook: its flat buffer and its parameters.

    It lives here, beside the collectives a hook calls, and not with the reducer that fills
    it: ``dist.GradBucket`` is the hook's interface, and the reducer (hpcgrad/ddp) sits above
    this package. ``gradient_views`` are the arrays of each parameter's gradient inside the
    buffer; ``buffer`` is a Tensor, or for a sparse-gradient parameter its SparseCOOTensor.
    """

    def __init__(self, index, buffer, parameters, gradient_views, is_last, sparse=False):
        self._index, self._is_last, self._sparse = index, is_last, sparse
        self._buffer = buffer if sparse else Tensor._make(buffer, False, None, 0)
        self._parameters, self._views = list(parameters), gradient_views

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    get_tensor = buffer

    def set_buffer(self, buffer):
        """Replace the bucket's flat buffer (a Tensor or array of its length), as PyTorch's
        ``GradBucket.set_buffer``: a wrapping hook (fp16_compress_wrapper) hands the hook it
        wraps a cast copy this way. ``gradients()`` still views the original buffer."""
        if self._sparse:
            raise RuntimeError("set_buffer: this bucket holds a sparse gradient "
                               "(bucket.is_sparse()); only a dense bucket's buffer can be replaced")
        tensor = buffer if isinstance(buffer, Tensor) else Tensor._make(buffer, False, None, 0)
        if tuple(tensor.shape) != tuple(self._buffer.shape):
            raise ValueError(f"set_buffer: expected a flat buffer of shape "
                             f"{list(self._buffer.shape)} (the bucket's), got {list(tensor.shape)}")
        self._buffer = tensor

    def is_last(self):
        return self._is_last

    def parameters(self):
        return list(self._parameters)

    def gradients(self):
        if self._sparse:
            return [self._buffer]
        return [Tensor._make(v, False, None, 0) for v in self._views]

    def is_sparse(self):
        return self._sparse
