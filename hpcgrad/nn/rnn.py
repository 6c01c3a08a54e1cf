"""Recurrent layers as in PyTorch: RNN, LSTM, GRU and their cells, built from differentiable ops.

Every step is a few existing ops (``F.linear``, ``sigmoid``, ``tanh``, ``chunk``, ``stack``), so
autograd needs no backward formula of its own; the input's projection ``x @ weight_ih.T +
bias_ih`` of a whole layer is one product before the time loop, the loop does only the
recurrent half. Parameter names, shapes, gate order (LSTM: i, f, g, o; GRU: r, z, n) and the
initialisation are PyTorch's, so a ``state_dict`` moves between the two libraries unchanged.
"""

import math
import numbers
import warnings

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import ops
from hpcgrad.tensor.ops.split import chunk, split
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._factory import parameter
from hpcgrad.nn._packed import PackedSequence
from hpcgrad.nn.module import Module

__all__ = ["GRU", "GRUCell", "LSTM", "LSTMCell", "RNN", "RNNBase", "RNNCell", "RNNCellBase"]


def _zeros(shape, like):
    return Tensor(backend.to_device(np.zeros(shape, dtype=like.dtype), like.device))


# --- one time step: gi is the input's projection (x @ w_ih.T + b_ih), already computed -------
def _rnn_step(activation):
    def step(gi, h, w_hh, b_hh):
        return activation(gi + F.linear(h, w_hh, b_hh))
    return step


_STEPS_RNN = {"tanh": _rnn_step(lambda x: x.tanh()), "relu": _rnn_step(lambda x: x.relu())}


def _lstm_step(gi, state, w_hh, b_hh, w_hr=None):
    h, c = state
    i, f, g, o = chunk(gi + F.linear(h, w_hh, b_hh), 4, -1)
    c = f.sigmoid() * c + i.sigmoid() * g.tanh()
    h = o.sigmoid() * c.tanh()
    return (h if w_hr is None else F.linear(h, w_hr)), c


def _gru_step(gi, h, w_hh, b_hh):
    i_r, i_z, i_n = chunk(gi, 3, -1)
    h_r, h_z, h_n = chunk(F.linear(h, w_hh, b_hh), 3, -1)
    r = (i_r + h_r).sigmoid()
    z = (i_z + h_z).sigmoid()
    n = (i_n + r * h_n).tanh()
    return n + z * (h - n)  # (1 - z) * n + z * h


# --- cells ----------------------------------------------------------------------------------
class RNNCellBase(Module):
    """weight_ih (chunks*hidden, input), weight_hh (chunks*hidden, hidden), bias_ih, bias_hh,
    all ~ U(-1/sqrt(hidden), 1/sqrt(hidden))."""

    def __init__(self, input_size, hidden_size, bias, num_chunks, device=None, dtype=None):
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        self.weight_ih = parameter((num_chunks * hidden_size, input_size), dtype, device)
        self.weight_hh = parameter((num_chunks * hidden_size, hidden_size), dtype, device)
        if bias:
            self.bias_ih = parameter((num_chunks * hidden_size,), dtype, device)
            self.bias_hh = parameter((num_chunks * hidden_size,), dtype, device)
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self):
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -stdv, stdv)

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity}"
        return s

    def _batched(self, input, name):
        if input.ndim not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.ndim}D instead")
        if input.shape[-1] != self.input_size:
            raise RuntimeError(f"{name}: input has inconsistent input_size: got "
                               f"{input.shape[-1]} expected {self.input_size}")
        return input.ndim == 2

    def _hidden(self, input, hx, batched):
        if hx is None:
            return _zeros((input.shape[0], self.hidden_size), input)
        hx = hx if batched else hx.unsqueeze(0)
        if tuple(hx.shape) != (input.shape[0], self.hidden_size):
            raise RuntimeError(f"{type(self).__name__}: expected hidden of shape "
                               f"{[input.shape[0], self.hidden_size]} (batch, hidden_size), "
                               f"got {list(hx.shape)}")
        return hx


class RNNCell(RNNCellBase):
    """h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh) (or relu); ``forward(input, hx=None)``."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None,
                 dtype=None):
        super().__init__(input_size, hidden_size, bias, 1, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input, hx=None):
        batched = self._batched(input, "RNNCell")
        if hx is not None and hx.ndim not in (1, 2):
            raise ValueError(f"RNNCell: Expected hidden to be 1D or 2D, got {hx.ndim}D instead")
        if self.nonlinearity not in _STEPS_RNN:
            raise RuntimeError(f"Unknown nonlinearity: {self.nonlinearity}")
        x = input if batched else input.unsqueeze(0)
        h = self._hidden(x, hx, batched)
        out = _STEPS_RNN[self.nonlinearity](F.linear(x, self.weight_ih, self.bias_ih), h,
                                            self.weight_hh, self.bias_hh)
        return out if batched else out.squeeze(0)


class LSTMCell(RNNCellBase):
    """Gates i, f, g, o; ``forward(input, (h, c)=None) -> (h', c')``."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__(input_size, hidden_size, bias, 4, device, dtype)

    def forward(self, input, hx=None):
        batched = self._batched(input, "LSTMCell")
        if hx is not None:
            for idx, value in enumerate(hx):
                if value.ndim not in (1, 2):
                    raise ValueError(f"LSTMCell: Expected hx[{idx}] to be 1D or 2D, got "
                                     f"{value.ndim}D instead")
        x = input if batched else input.unsqueeze(0)
        h, c = (None, None) if hx is None else hx
        state = self._hidden(x, h, batched), self._hidden(x, c, batched)
        h, c = _lstm_step(F.linear(x, self.weight_ih, self.bias_ih), state, self.weight_hh,
                          self.bias_hh)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(RNNCellBase):
    """Gates r, z, n; ``forward(input, hx=None) -> h'``."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__(input_size, hidden_size, bias, 3, device, dtype)

    def forward(self, input, hx=None):
        batched = self._batched(input, "GRUCell")
        if hx is not None and hx.ndim not in (1, 2):
            raise ValueError(f"GRUCell: Expected hidden to be 1D or 2D, got {hx.ndim}D instead")
        x = input if batched else input.unsqueeze(0)
        h = self._hidden(x, hx, batched)
        out = _gru_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                        self.bias_hh)
        return out if batched else out.squeeze(0)


# --- multi-layer, (bi)directional sequences -------------------------------------------------
def _state_rows(state, pair):
    return (state[0] if pair else state).shape[0]


_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


class RNNBase(Module):
    """Parameters per layer k and direction (suffix "" or "_reverse"): weight_ih_l{k},
    weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k} (and LSTM's weight_hr_l{k} with proj_size),
    registered in PyTorch's order, all ~ U(-1/sqrt(hidden), 1/sqrt(hidden))."""

    def __init__(self, mode, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, proj_size=0,
                 device=None, dtype=None):
        super().__init__()
        if (not isinstance(dropout, numbers.Number) or isinstance(dropout, bool)
                or not 0 <= dropout <= 1):
            raise ValueError("dropout should be a number in range [0, 1] representing the "
                             "probability of an element being zeroed")
        if dropout > 0 and num_layers == 1:
            warnings.warn("dropout option adds dropout after all but last recurrent layer, so "
                          "non-zero dropout expects num_layers greater than 1, but got "
                          f"dropout={dropout} and num_layers={num_layers}", stacklevel=3)
        for name, value, kind in (("bias", bias, bool), ("batch_first", batch_first, bool),
                                  ("input_size", input_size, int),
                                  ("hidden_size", hidden_size, int)):
            if not isinstance(value, kind):
                raise TypeError(f"{name} should be of type {kind.__name__}, got: "
                                f"{type(value).__name__}")
        if input_size <= 0:
            raise ValueError("input_size must be greater than zero")
        if hidden_size <= 0:
            raise ValueError("hidden_size must be greater than zero")
        if num_layers <= 0:
            raise ValueError("num_layers must be greater than zero")
        if proj_size < 0:
            raise ValueError("proj_size should be a positive integer or zero to disable "
                             "projections")
        if proj_size >= hidden_size:
            raise ValueError("proj_size has to be smaller than hidden_size")
        if mode not in _GATES:
            raise ValueError("Unrecognized RNN mode: " + mode)
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional, self.proj_size = float(dropout), bidirectional, proj_size
        gate_size = _GATES[mode] * hidden_size
        real_hidden = proj_size if proj_size > 0 else hidden_size
        directions = 2 if bidirectional else 1
        self._flat_weights_names, self._all_weights = [], []
        for layer in range(num_layers):
            for direction in range(directions):
                layer_input = input_size if layer == 0 else real_hidden * directions
                suffix = "_reverse" if direction == 1 else ""
                shapes = [("weight_ih", (gate_size, layer_input)),
                          ("weight_hh", (gate_size, real_hidden))]
                if bias:
                    shapes += [("bias_ih", (gate_size,)), ("bias_hh", (gate_size,))]
                if proj_size > 0:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                names = []
                for stem, shape in shapes:
                    names.append(f"{stem}_l{layer}{suffix}")
                    setattr(self, names[-1], parameter(shape, dtype, device))
                self._flat_weights_names.extend(names)
                self._all_weights.append(names)
        self.reset_parameters()

    def reset_parameters(self):
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -stdv, stdv)

    def flatten_parameters(self):
        """PyTorch's cuDNN hook; nothing to flatten here."""

    @property
    def _flat_weights(self):
        return [getattr(self, name) for name in self._flat_weights_names]

    @property
    def all_weights(self):
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        return s

    # -- checks, with PyTorch's wording --
    def _check_input(self, input, name, tensor_word, packed=False):
        if not isinstance(input, Tensor):
            raise TypeError(f"{name}: expected input to be a hpcgrad Tensor (seq_len, batch, "
                            f"input_size) or a PackedSequence, got {type(input).__name__}")
        if packed and input.ndim != 2:
            raise RuntimeError(f"input must have 2 dimensions, got {input.ndim}")
        if input.ndim not in (2, 3):
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.ndim}D"
                             f"{tensor_word} instead")
        weight = getattr(self, self._flat_weights_names[0])
        if input.dtype != weight.dtype:
            raise ValueError(f"RNN input dtype ({input.dtype}) does not match weight dtype "
                             f"({weight.dtype}). Convert input: input.to({weight.dtype}), or "
                             f"convert model: model.to({input.dtype})")
        if input.shape[-1] != self.input_size:
            raise RuntimeError(f"input.size(-1) must be equal to input_size. Expected "
                               f"{self.input_size}, got {input.shape[-1]}")
        return packed or input.ndim == 3

    def _expected_hidden(self, batch, size):
        return (self.num_layers * (2 if self.bidirectional else 1), batch, size)

    @staticmethod
    def _check_hidden(hx, expected, msg="Expected hidden size {}, got {}"):
        if tuple(hx.shape) != expected:
            raise RuntimeError(msg.format(expected, list(hx.shape)))

    def _run(self, input, hx, step, sizes=None):
        """input (T, N, in), or a PackedSequence's data with its batch ``sizes`` per step; hx:
        per-direction-layer states stacked on axis 0 (a tensor, or LSTM's pair); returns output
        (T, N, D*H) (packed: data of D*H features) and the final states in the same form."""
        directions = 2 if self.bidirectional else 1
        steps = input.shape[0] if sizes is None else len(sizes)
        if steps == 0:
            raise RuntimeError(f"{type(self).__name__}: expected a sequence of at least one "
                               f"step, got input of shape {list(input.shape)}")
        pair = isinstance(hx, tuple)
        finals = []
        layer_input = input
        for layer in range(self.num_layers):
            outs = []
            for direction in range(directions):
                index = layer * directions + direction
                params = [getattr(self, n) for n in self._all_weights[index]]
                w_ih, w_hh = params[0], params[1]
                b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
                extra = params[-1:] if self.proj_size > 0 else []
                gi = F.linear(layer_input, w_ih, b_ih)
                gi = gi.unbind(0) if sizes is None else split(gi, sizes, 0)
                state = (hx[0][index], hx[1][index]) if pair else hx[index]
                ys = [None] * steps
                order = range(steps - 1, -1, -1) if direction == 1 else range(steps)
                for t in order:
                    active = gi[t].shape[0]
                    if active == _state_rows(state, pair):
                        state = step(gi[t], state, w_hh, b_hh, *extra)
                    else:  # packed: the sequences past their end keep their state
                        rest = state
                        new = step(gi[t], tuple(s[:active] for s in state) if pair
                                   else state[:active], w_hh, b_hh, *extra)
                        state = tuple(ops.cat([n, r[active:]], 0) for n, r in zip(new, rest)) \
                            if pair else ops.cat([new, rest[active:]], 0)
                        ys[t] = new[0] if pair else new
                        continue
                    ys[t] = state[0] if pair else state
                outs.append(ops.stack(ys, 0) if sizes is None else ops.cat(ys, 0))
                finals.append(state)
            layer_input = outs[0] if directions == 1 else ops.cat(outs, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, True)
        if pair:
            return layer_input, (ops.stack([s[0] for s in finals], 0),
                                 ops.stack([s[1] for s in finals], 0))
        return layer_input, ops.stack(finals, 0)

    def _forward(self, input, hx, name, tensor_word, step):
        packed = isinstance(input, PackedSequence)
        sizes = order = unorder = None
        if packed:
            input, batch_sizes, order, unorder = input
            sizes = [int(b) for b in batch_sizes.detach().cpu().numpy()]
        batched = self._check_input(input, name, tensor_word, packed)
        pair = self.mode == "LSTM"
        if packed:
            batch = sizes[0]
        elif not batched:
            input = input.unsqueeze(1)
        elif self.batch_first:
            input = input.transpose(0, 1)
        if not packed:
            batch = input.shape[1]
        real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h0 = _zeros(self._expected_hidden(batch, real_hidden), input)
            hx = (h0, _zeros(self._expected_hidden(batch, self.hidden_size), input)) \
                if pair else h0
        else:
            want = 3 if batched else 2
            dims = tuple(h.ndim for h in hx) if pair else hx.ndim
            bad = any(d != want for d in dims) if pair else dims != want
            if bad:
                kind = "batched 3-D" if batched else "unbatched 2-D"
                if pair:
                    raise RuntimeError(f"For {kind} input, hx and cx should also be {want}-D but "
                                       f"got ({dims[0]}-D, {dims[1]}-D) tensors")
                raise RuntimeError(f"For {kind} input, hx should also be {want}-D but got "
                                   f"{dims}-D tensor")
            if not batched:
                hx = tuple(h.unsqueeze(1) for h in hx) if pair else hx.unsqueeze(1)
            if pair:
                self._check_hidden(hx[0], self._expected_hidden(batch, real_hidden),
                                   "Expected hidden[0] size {}, got {}")
                self._check_hidden(hx[1], self._expected_hidden(batch, self.hidden_size),
                                   "Expected hidden[1] size {}, got {}")
            else:
                self._check_hidden(hx, self._expected_hidden(batch, real_hidden))
            if order is not None:  # the caller's batch order -> the packed (sorted) order
                hx = tuple(ops.index_select(h, 1, order) for h in hx) if pair \
                    else ops.index_select(hx, 1, order)
        output, hidden = self._run(input, hx, step, sizes)
        if packed:
            if unorder is not None:
                hidden = tuple(ops.index_select(h, 1, unorder) for h in hidden) if pair \
                    else ops.index_select(hidden, 1, unorder)
            return PackedSequence(output, batch_sizes, order, unorder), hidden
        if not batched:
            output = output.squeeze(1)
            hidden = tuple(h.squeeze(1) for h in hidden) if pair else hidden.squeeze(1)
        elif self.batch_first:
            output = output.transpose(0, 1)
        return output, hidden


class RNN(RNNBase):
    """Elman RNN, tanh or relu: ``forward(input, h_0=None) -> (output, h_n)``; input (L, N,
    H_in), (N, L, H_in) with ``batch_first`` or unbatched (L, H_in)."""

    def __init__(self, *args, **kwargs):
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        if len(args) > 3:
            kwargs["nonlinearity"] = args[3]
            args = args[:3] + args[4:]
        nonlinearity = kwargs.pop("nonlinearity", "tanh")
        if nonlinearity == "tanh":
            mode = "RNN_TANH"
        elif nonlinearity == "relu":
            mode = "RNN_RELU"
        else:
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or "
                             f"'relu'.")
        super().__init__(mode, *args, **kwargs)
        self.nonlinearity = nonlinearity

    def forward(self, input, hx=None):
        step = _STEPS_RNN[self.nonlinearity]
        return self._forward(input, hx, "RNN", " tensor", step)


class LSTM(RNNBase):
    """``forward(input, (h_0, c_0)=None) -> (output, (h_n, c_n))``; ``proj_size > 0`` projects
    each h by weight_hr_l{k} (h_n and output then have proj_size features)."""

    def __init__(self, *args, **kwargs):
        super().__init__("LSTM", *args, **kwargs)

    def forward(self, input, hx=None):
        return self._forward(input, hx, "LSTM", "", _lstm_step)


class GRU(RNNBase):
    """``forward(input, h_0=None) -> (output, h_n)``; gates r, z, n as in PyTorch (the reset
    gate multiplies h W_hn^T + b_hn)."""

    def __init__(self, *args, **kwargs):
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        super().__init__("GRU", *args, **kwargs)

    def forward(self, input, hx=None):
        return self._forward(input, hx, "GRU", "", _gru_step)
