"""Packed sequences as torch.nn.utils.rnn: PackedSequence, pack/pad helpers (differentiable).

A PackedSequence holds the steps of a batch of sequences sorted by decreasing length, time-major:
``data`` stacks step t's rows of the ``batch_sizes[t]`` sequences still running. The recurrent
layers (hpcgrad/nn/rnn.py) run step t on the first ``batch_sizes[t]`` rows of their state only, so
each sequence's h_n is its state after its own last step, as PyTorch's.
"""

from collections import namedtuple

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import ops
from hpcgrad.tensor.ops.split import split
from hpcgrad.tensor._tensor import Tensor

__all__ = ["PackedSequence", "pack_padded_sequence", "pad_packed_sequence", "pack_sequence",
           "pad_sequence"]


def _host(x):
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _ints(array):
    return Tensor(np.ascontiguousarray(array, dtype=np.int64))


class PackedSequence(namedtuple("PackedSequence",
                                ["data", "batch_sizes", "sorted_indices", "unsorted_indices"])):
    """(data, batch_sizes, sorted_indices, unsorted_indices); build it with
    ``pack_padded_sequence`` or ``pack_sequence``, not by hand."""

    def __new__(cls, data, batch_sizes=None, sorted_indices=None, unsorted_indices=None):
        if unsorted_indices is None and sorted_indices is not None:
            unsorted_indices = _ints(np.argsort(_host(sorted_indices)))
        return super().__new__(cls, data, batch_sizes, sorted_indices, unsorted_indices)

    @property
    def is_cuda(self):
        return self.data.device != backend.CPU


def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
    """Pack a padded (T, B, *) batch (or (B, T, *) with ``batch_first``) of the given lengths."""
    lengths = _host(lengths).astype(np.int64).reshape(-1)
    if enforce_sorted:
        if np.any(np.diff(lengths) > 0):
            raise RuntimeError("`lengths` array must be sorted in decreasing order when "
                               "`enforce_sorted` is True. You can pass `enforce_sorted=False` "
                               "to pack_padded_sequence and/or pack_sequence to sidestep this "
                               "requirement if you do not need ONNX exportability.")
        sorted_indices = None
    else:
        order = np.argsort(-lengths, kind="stable")
        lengths = lengths[order]
        sorted_indices = _ints(order)
        input = ops.index_select(input, 0 if batch_first else 1, order)
    if batch_first:
        input = input.transpose(0, 1)
    if lengths.size != input.shape[1]:
        raise ValueError(f"Expected `len(lengths)` to be equal to batch_size, but got "
                         f"{lengths.size} (batch_size={input.shape[1]})")
    if lengths.size and lengths[-1] <= 0:
        raise RuntimeError("Length of all samples has to be greater than 0, but found an "
                           "element in 'lengths' that is <= 0")
    if lengths.size and lengths[0] > input.shape[0]:
        raise RuntimeError(f"pack_padded_sequence: a length {int(lengths[0])} exceeds the "
                           f"padded sequence length {input.shape[0]}")
    steps = int(lengths[0]) if lengths.size else 0
    batch_sizes = (lengths[None, :] > np.arange(steps)[:, None]).sum(1)
    data = ops.cat([input[t, :int(b)] for t, b in enumerate(batch_sizes)], 0)
    return PackedSequence(data, _ints(batch_sizes), sorted_indices, None)


def pad_packed_sequence(sequence, batch_first=False, padding_value=0.0, total_length=None):
    """Inverse of ``pack_padded_sequence``: (padded, lengths), in the original batch order."""
    data, batch_sizes, _, unsorted = sequence
    sizes = _host(batch_sizes).astype(np.int64)
    steps, batch = len(sizes), int(sizes[0])
    if total_length is not None:
        if total_length < steps:
            raise ValueError(f"Expected total_length to be at least the length of the longest "
                             f"sequence in input, but got total_length={total_length} and max "
                             f"sequence length being {steps}")
    rows = split(data, [int(s) for s in sizes], 0) if steps else []
    feature = tuple(data.shape[1:])

    def pad(count):
        array = np.full((count,) + feature, padding_value, dtype=data.dtype)
        return Tensor(backend.to_device(array, data.device))

    padded = [r if r.shape[0] == batch else ops.cat([r, pad(batch - r.shape[0])], 0)
              for r in rows]
    extra = (total_length or steps) - steps
    padded += [pad(batch)] * extra
    out = ops.stack(padded, 0)
    lengths = (sizes[None, :] > np.arange(batch)[:, None]).sum(1)
    if unsorted is not None:
        order = _host(unsorted)
        out, lengths = ops.index_select(out, 1, order), lengths[order]
    if batch_first:
        out = out.transpose(0, 1)
    return out, _ints(lengths)


def pad_sequence(sequences, batch_first=False, padding_value=0.0, padding_side="right"):
    """Stack (L_i, *) tensors into (max L, B, *) (or (B, max L, *)), padded with
    ``padding_value`` on ``padding_side``."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"Expected padding_side to be one of left or right, but got "
                         f"{padding_side}.")
    sequences = list(sequences)
    longest = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        gap = longest - s.shape[0]
        if gap:
            fill = Tensor(backend.to_device(
                np.full((gap,) + tuple(s.shape[1:]), padding_value, dtype=s.dtype), s.device))
            s = ops.cat([s, fill] if padding_side == "right" else [fill, s], 0)
        padded.append(s)
    return ops.stack(padded, 0 if batch_first else 1)


def pack_sequence(sequences, enforce_sorted=True):
    """Pack a list of (L_i, *) tensors (by decreasing length unless ``enforce_sorted=False``)."""
    lengths = [s.shape[0] for s in sequences]
    return pack_padded_sequence(pad_sequence(sequences), lengths, enforce_sorted=enforce_sorted)
