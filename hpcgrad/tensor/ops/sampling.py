"""Random draws: bernoulli (and bernoulli_), multinomial, normal, dropout, exponential_.

Drawn on the host from hpcgrad's generator (creation.default_generator(), which manual_seed
reseeds, or ``generator=``) and copied to the tensor's device, as inplace.py's random fills.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import creation
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops._common_args import as_tensor, const
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.inplace import _RandomFill, _float_check, _generator, _prepare


class Drawn(Function):
    """Values drawn from distributions whose parameters are ``a`` and ``b`` (tensors or
    numbers): in the graph with a zero gradient, as PyTorch's bernoulli and normal."""

    @staticmethod
    def forward(ctx, a, b, values):
        return values

    @staticmethod
    def backward(ctx, g):
        zeros = Tensor._zeros(g.array.shape, g.array.dtype, g.device)
        return (zeros if ctx.needs_input_grad[0] else None,
                zeros if ctx.needs_input_grad[1] else None, None)


def _host(array):
    return backend.to_device(array, "cpu")


def _on(values, like):
    return backend.to_device(values, like.device) if isinstance(like, Tensor) else values


def _check_p(p):
    if not ((p >= 0) & (p <= 1)).all():
        raise RuntimeError("Expected p_in >= 0 && p_in <= 1 to be true, but got false.  "
                           "(bernoulli's probabilities must lie in [0, 1])")


@method
def bernoulli(input, p=None, *, generator=None):
    """0/1 draws, 1 with probability ``input`` (or ``p``), in input's dtype and shape."""
    input = as_tensor(input)
    probs = np.asarray(_host(input.array) if p is None else
                       (_host(p.array) if isinstance(p, Tensor) else p),
                       dtype=np.float64)
    _check_p(probs)
    u = _generator(generator).random(input.shape)
    values = (u < probs).astype(input.array.dtype if input.array.dtype.kind in "fc"
                                else np.float32)
    return Drawn.apply(input, None, _on(values, input))


function(bernoulli)


class Bernoulli(_RandomFill):
    """bernoulli_"""


class Exponential(_RandomFill):
    """exponential_"""


@method
def bernoulli_(self, p=0.5, *, generator=None):
    """Fill with 0/1 draws, 1 with probability ``p`` (a number or a tensor of probabilities)."""
    _prepare(self)
    probs = np.asarray(_host(p.array) if isinstance(p, Tensor) else p,
                       dtype=np.float64)
    _check_p(probs)
    u = _generator(generator).random(self.shape)
    return Bernoulli.apply(self, (u < probs).astype(self.array.dtype))


@method
def exponential_(self, lambd=1.0, *, generator=None):
    """Fill with draws from the exponential distribution of rate ``lambd``."""
    _prepare(self)
    if not lambd > 0.0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    dtype = _float_check(self, "exponential_cpu")
    values = _generator(generator).exponential(1.0 / lambd, self.shape)
    return Exponential.apply(self, values.astype(dtype))


@method
def multinomial(input, num_samples, replacement=False, *, generator=None):
    """``num_samples`` category indices per row of the (unnormalised, non-negative) weights
    ``input`` (1-D or 2-D); without replacement each index at most once per row."""
    input = as_tensor(input)
    if input.ndim not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim (got {input.ndim} dims)")
    if input.array.dtype.kind != "f":
        raise RuntimeError("multinomial only supports floating-point dtypes for input")
    if num_samples <= 0:
        raise RuntimeError(f"cannot sample n_sample <= 0 samples (got {num_samples})")
    n = input.shape[-1]
    if not replacement and num_samples > n:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           f"replacement (n_sample = {num_samples}, {n} categories)")
    rng = _generator(generator)
    weights = _host(input.array).astype(np.float64).reshape(-1, n)
    if (weights < 0).any() or not np.isfinite(weights).all():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    rows = []
    for w in weights:
        if w.sum() <= 0:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        if not replacement and num_samples > np.count_nonzero(w):
            raise RuntimeError("invalid multinomial distribution (with replacement=False, not "
                               "enough non-negative category to sample)")
        rows.append(rng.choice(n, num_samples, replace=replacement, p=w / w.sum()))
    out = np.stack(rows).astype(np.int64)
    return const(backend.to_device(out.reshape(input.shape[:-1] + (num_samples,)), input.device))


function(multinomial)


@function
def normal(mean=0.0, std=1.0, size=None, *, generator=None, dtype=None, device=None,
           requires_grad=False, out=None):
    """Draws from N(mean, std**2): ``mean`` and/or ``std`` tensors (broadcast; the result has
    their shape), or two numbers and a ``size``. In the graph with a zero gradient."""
    if out is not None:
        raise NotImplementedError("normal: out= is not built; use the result")
    rng = _generator(generator)
    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if not tensors:
        if size is None:
            raise TypeError("normal(): with a number mean and std, give size")
        values = mean + std * rng.standard_normal(creation._shape((size,)))
        made = creation.tensor(values, dtype=dtype, device=device)
        return made.requires_grad_(requires_grad)
    m = _host(mean.array) if isinstance(mean, Tensor) else np.asarray(mean)
    s = _host(std.array) if isinstance(std, Tensor) else np.asarray(std)
    if (s < 0).any():
        raise RuntimeError(f"normal expects all elements of std >= 0.0 (got {s.min():g})")
    shape = np.broadcast_shapes(m.shape, s.shape)
    values = m + s * rng.standard_normal(shape)
    like = tensors[0]
    values = values.astype(like.array.dtype if like.array.dtype.kind == "f" else np.float32)
    return Drawn.apply(mean, std, _on(values, like))


@function
def dropout(input, p=0.5, train=True):
    """``torch.dropout``: zero each element with probability ``p`` and scale the rest by
    ``1 / (1 - p)`` (the same draws as nn.functional.dropout for one seed)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not train or p == 0.0:
        return input
    if p == 1.0:
        return input * 0.0
    dtype = input.dtype if input.dtype in (np.float32, np.float64) else np.float64
    keep = creation.default_generator().random(input.shape, dtype=dtype) >= p
    mask = (keep * (1.0 / (1.0 - p))).astype(input.dtype)
    return input * const(backend.to_device(mask, input.device))

