"""Categorical: a distribution over {0, ..., K-1} given probs or logits (torch.distributions.Categorical)."""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import creation
from hpcgrad.tensor.functional import log_softmax
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.distributions import constraints
from hpcgrad.distributions.distribution import Distribution, lazy_property


def _const(array):
    return Tensor._make(array, False, None, 0)


class Categorical(Distribution):
    """Samples are indices into the last dimension of ``probs`` (non-negative, normalized here
    to sum 1) or ``logits`` (unnormalized log-probabilities); the dimensions before it are the
    batch. ``log_prob`` and ``entropy`` are differentiable in the one given."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    has_enumerate_support = True

    def __init__(self, probs=None, logits=None, validate_args=None):
        if (probs is None) == (logits is None):
            raise ValueError("Either `probs` or `logits` must be specified, but not both.")
        if probs is not None:
            if probs.dim() < 1:
                raise ValueError("`probs` parameter must be at least one-dimensional.")
            self.probs = probs / probs.sum(-1, keepdim=True)
        else:
            if logits.dim() < 1:
                raise ValueError("`logits` parameter must be at least one-dimensional.")
            self.logits = log_softmax(logits, -1)  # logits - logits.logsumexp(-1, keepdim=True)
        self._param = self.probs if probs is not None else self.logits
        self._num_events = self._param.shape[-1]
        batch_shape = self._param.shape[:-1] if self._param.dim() > 1 else ()
        super().__init__(batch_shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = _instance or Categorical.__new__(Categorical)
        batch_shape = tuple(batch_shape)
        param_shape = batch_shape + (self._num_events,)
        if "probs" in self.__dict__:
            new.probs = self.probs.expand(*param_shape)
            new._param = new.probs
        if "logits" in self.__dict__:
            new.logits = self.logits.expand(*param_shape)
            new._param = new.logits
        new._num_events = self._num_events
        Distribution.__init__(new, batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def support(self):
        return constraints.integer_interval(0, self._num_events - 1)

    @lazy_property
    def logits(self):
        """log(probs), the probs clamped to [eps, 1 - eps] first (PyTorch's probs_to_logits)."""
        eps = float(np.finfo(self.probs.dtype).eps)
        return self.probs.clamp(min=eps, max=1 - eps).log()

    @lazy_property
    def probs(self):
        """softmax(logits) (PyTorch's logits_to_probs)."""
        return self.logits.softmax(-1)

    @property
    def param_shape(self):
        return tuple(self._param.shape)

    @property
    def mean(self):
        return self._nan()

    @property
    def variance(self):
        return self._nan()

    def _nan(self):
        xp = backend.get_array_module(self.probs.array)
        return _const(xp.full(self._extended_shape(), math.nan, dtype=self.probs.dtype))

    @property
    def mode(self):
        return self.probs.argmax(-1)

    def sample(self, sample_shape=()):
        """Indices drawn with the probabilities (from hpcgrad's global generator, which
        manual_seed seeds), shape ``sample_shape + batch_shape``, int64, outside the graph."""
        sample_shape = (sample_shape,) if isinstance(sample_shape, int) else tuple(sample_shape)
        probs = self.probs.array.reshape(-1, self._num_events)
        host = backend.to_device(probs, "cpu").astype(np.float64)
        cdf = np.cumsum(host, axis=-1)
        n = math.prod(sample_shape)
        u = creation.default_generator().random((probs.shape[0], n)) * cdf[:, -1:]
        # The first index whose cumulative probability exceeds u (as torch.multinomial with
        # replacement); an index of zero probability is never drawn.
        draws = (u[:, :, None] >= cdf[:, None, :]).sum(-1)
        draws = np.minimum(draws, self._num_events - 1).T
        out = draws.reshape(self._extended_shape(sample_shape)).astype(np.int64)
        return _const(backend.to_device(out, self._param.device))

    def log_prob(self, value):
        """log P(value) per batch element: gathered from the normalized logits."""
        if self._validate_args:
            self._validate_sample(value)
        index = value.long().unsqueeze(-1)
        log_pmf = self.logits
        shape = np.broadcast_shapes(tuple(index.shape), tuple(log_pmf.shape))
        index = index.expand(*shape[:-1], 1)
        log_pmf = log_pmf.expand(*shape)
        return log_pmf.gather(-1, index).squeeze(-1)

    def entropy(self):
        """-sum(p log p) over the events (a zero-probability event adds 0)."""
        min_real = float(np.finfo(self.logits.dtype).min)
        logits = self.logits.clamp(min=min_real)
        return -(logits * self.probs).sum(-1)

    def enumerate_support(self, expand=True):
        """Every value, 0..K-1, along a new first dimension (expanded over the batch)."""
        xp = backend.get_array_module(self._param.array)
        values = _const(xp.arange(self._num_events, dtype=np.int64))
        values = values.reshape((-1,) + (1,) * len(self._batch_shape))
        if expand:
            values = values.expand(-1, *self._batch_shape)
        return values
