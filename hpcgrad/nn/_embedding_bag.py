"""EmbeddingBag: sums, means or maxes of bags of embedding rows, built on embedding + scatter_add.

Bags are given as PyTorch gives them: a 1-D index tensor with ``offsets`` (where each bag
starts; ``include_last_offset`` adds the end), or a 2-D (bags, length) tensor. Entries equal
to ``padding_idx`` are left out of their bag (and of its count in ``mean``); an empty bag gives
zeros. Gradients come from the ops used (embedding's row gradient, gather, scatter_add), so
``sparse=True`` gives the weight embedding's row-sparse gradient in sum and mean modes.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._factory import parameter
from hpcgrad.nn.module import Module
from hpcgrad.nn.parameter import Parameter


def _host(x):
    """The integer array behind an index argument (a Tensor, array or list)."""
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _const(array, like):
    return Tensor(backend.to_device(np.ascontiguousarray(array), like.device))


def _bags(input, offsets, include_last_offset, per_sample_weights):
    """-> (flat indices, bag of each used entry, number of bags, flat per-sample weights)."""
    idx = _host(input)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding_bag: indices must be integers (int64 or int32), got "
                        f"{idx.dtype}")
    if per_sample_weights is not None and tuple(per_sample_weights.shape) != idx.shape:
        raise ValueError(f"embedding_bag: If per_sample_weights ({list(per_sample_weights.shape)}"
                         f") is not None, then it must have the same shape as the input "
                         f"({list(idx.shape)})")
    if idx.ndim == 2:
        if offsets is not None:
            raise ValueError(f"if input is 2D, then offsets has to be None, as input is treated "
                             f"is a mini-batch of fixed length sequences. However, found "
                             f"offsets of type {type(offsets)}")
        count, length = idx.shape
        bag = np.repeat(np.arange(count), length)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        return idx.reshape(-1), bag, count, per_sample_weights
    if idx.ndim != 1:
        raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension "
                         f"{idx.ndim}")
    if offsets is None:
        raise ValueError("offsets has to be a 1D Tensor but got None")
    off = _host(offsets)
    if off.ndim != 1:
        raise ValueError("offsets has to be a 1D Tensor")
    if off.dtype.kind not in "iu":
        raise TypeError(f"embedding_bag: offsets must be integers (int64 or int32), got "
                        f"{off.dtype}")
    if off.size and off[0] != 0:
        raise ValueError(f"offsets[0] has to be 0, i.e., the first sequence in the mini-batch "
                         f"has to start from position 0. However, got {int(off[0])}")
    end = len(idx)
    if include_last_offset:
        if off.size == 0:
            raise ValueError("include_last_offset: offsets needs at least one entry (the end)")
        # The last offset should be len(input); like PyTorch's CPU kernel, the last bag runs
        # to the end of the input whatever it says.
        off, end = off[:-1], max(int(off[-1]), len(idx))
    if np.any(np.diff(off) < 0) or (off.size and off[-1] > end) or end > len(idx):
        raise ValueError(f"offsets must be non-decreasing and within the input's length "
                         f"{len(idx)}, got {_host(offsets).tolist()}")
    bag = np.searchsorted(off, np.arange(end), side="right") - 1
    return idx[:end], bag, len(off), per_sample_weights


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
                  mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
                  padding_idx=None):
    """PyTorch's ``F.embedding_bag``: (bags, embedding_dim), the ``mode`` of each bag's rows."""
    if weight.ndim != 2:
        raise ValueError(f"weight has to be a 2D Tensor, but got Tensor of dimension "
                         f"{weight.ndim}")
    if mode not in ("sum", "mean", "max"):
        raise ValueError("mode has to be one of sum, mean or max")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError("max mode does not support scaling the gradient by the frequency")
    if mode == "max" and sparse:
        raise ValueError("max mode does not support sparse weights")
    num, dim = weight.shape
    if padding_idx is not None:
        if not -num <= padding_idx < num:
            raise ValueError(f"padding_idx must be within num_embeddings ({num}), got "
                             f"{padding_idx}")
        padding_idx %= num
    idx, bag, count, weights = _bags(input, offsets, include_last_offset, per_sample_weights)
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(f"embedding_bag: per_sample_weights was not None. "
                                  f"per_sample_weights is only supported for mode='sum' "
                                  f"(got mode='{mode}'). Use mode='sum', or scale the rows "
                                  f"yourself.")
    used = np.arange(len(idx)) if padding_idx is None else np.flatnonzero(idx != padding_idx)
    idx, bag = idx[used], bag[used]
    rows = F.embedding(idx, weight, None, max_norm, norm_type, scale_grad_by_freq, sparse)
    out = _const(np.zeros((count, dim), dtype=weight.dtype), weight)
    if mode == "max":
        if not len(idx):
            return out
        values = rows.detach().cpu().numpy()
        bags, starts = np.unique(bag, return_index=True)  # bag is sorted: starts of segments
        inverse = np.repeat(np.arange(len(bags)), np.diff(np.append(starts, len(bag))))
        top = np.maximum.reduceat(values, starts, axis=0)
        # The first row that reaches the maximum, per bag and column, as PyTorch's CPU kernel.
        where = np.where(values == top[inverse], np.arange(len(idx))[:, None], len(idx))
        pick = np.minimum.reduceat(where, starts, axis=0)
        picked = rows.gather(0, _const(pick, weight))
        return out.scatter_add(0, _const(np.broadcast_to(bags[:, None], pick.shape), weight),
                               picked)
    if weights is not None:
        if weights.dtype != weight.dtype:
            raise ValueError(f"embedding_bag: expected per_sample_weights of the weight's dtype "
                             f"{weight.dtype}, got {weights.dtype}")
        rows = rows * weights[_const(used, weight)].unsqueeze(1)
    if mode == "mean":
        sizes = np.bincount(bag, minlength=count)
        scale = (1.0 / np.maximum(sizes, 1))[bag].astype(weight.dtype)
        rows = rows * _const(scale[:, None], weight)
    return out.scatter_add(0, _const(np.broadcast_to(bag[:, None], (len(idx), dim)), weight),
                           rows)


class EmbeddingBag(Module):
    """weight (num_embeddings, embedding_dim) ~ N(0, 1), the ``padding_idx`` row zero;
    ``forward(input, offsets=None, per_sample_weights=None)`` as ``embedding_bag``."""

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, mode="mean", sparse=False, _weight=None,
                 include_last_offset=False, padding_idx=None, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings "
                                 f"({num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        if _weight is None:
            self.weight = parameter((num_embeddings, embedding_dim), dtype, device)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"Shape of weight {list(_weight.shape)} does not match "
                                 f"num_embeddings and embedding_dim "
                                 f"{[num_embeddings, embedding_dim]}")
            self.weight = _weight if isinstance(_weight, Parameter) else Parameter(_weight)
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset

    def reset_parameters(self):
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight.array[self.padding_idx] = 0

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False,
                        include_last_offset=False, padding_idx=None):
        if embeddings.ndim != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        weight = Parameter(embeddings.detach() if isinstance(embeddings, Tensor) else embeddings,
                           requires_grad=not freeze)
        return cls(rows, cols, max_norm, norm_type, scale_grad_by_freq, mode, sparse, weight,
                   include_last_offset, padding_idx)

    def forward(self, input, offsets=None, per_sample_weights=None):
        return embedding_bag(input, self.weight, offsets, self.max_norm, self.norm_type,
                             self.scale_grad_by_freq, self.mode, self.sparse, per_sample_weights,
                             self.include_last_offset, self.padding_idx)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm!r}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type!r}"
        if self.scale_grad_by_freq is not False:
            s += f", scale_grad_by_freq={self.scale_grad_by_freq!r}"
        s += f", mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx!r}"
        return s
