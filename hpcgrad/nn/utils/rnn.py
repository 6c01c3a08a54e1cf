"""PyTorch's ``torch.nn.utils.rnn`` path for the packed-sequence helpers (hpcgrad/nn/_packed.py)."""

from hpcgrad.nn._packed import (PackedSequence, pack_padded_sequence, pack_sequence,  # noqa: F401
                                pad_packed_sequence, pad_sequence)
