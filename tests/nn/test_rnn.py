"""RNN, LSTM, GRU and their cells beside PyTorch CPU in float64: outputs, final states, and the
gradients of the input, the initial states and every parameter (torch's weights are copied into
ours by state_dict name). ``compare`` holds the logic; the cases are thin wrappers."""

import warnings

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn

torch = pytest.importorskip("torch")


def _np(t):
    return t.detach().numpy()


def _flat(out):
    """Output tensors in order: (output, h) / (output, (h, c)) / h / (h, c)."""
    if isinstance(out, tuple):
        return [t for o in out for t in _flat(o)]
    return [out]


def _run(module, lib, x, states):
    """Forward and backward of sum_k <out_k, v_k> (fixed random v_k); returns the outputs, the
    input's and the states' gradients."""
    make = hg.tensor if lib == "hg" else torch.from_numpy
    xt = make(x.copy()).requires_grad_(True)
    st = None
    if states is not None:
        st = [make(s.copy()).requires_grad_(True) for s in states]
    args = (xt,) if st is None else (xt, st[0] if len(st) == 1 else tuple(st))
    outs = _flat(module(*args))
    rng = np.random.default_rng(7)
    total = None
    for o in outs:
        term = (o * make(rng.standard_normal(tuple(o.shape)))).sum()
        total = term if total is None else total + term
    total.backward()
    return ([_np(o) for o in outs], _np(xt.grad),
            [_np(s.grad) for s in st] if st is not None else [])


def compare(name, args, kwargs, x, states=None, rtol=1e-10, atol=1e-12):
    ours = getattr(hnn, name)(*args, **kwargs).double()
    theirs = getattr(torch.nn, name)(*args, **kwargs).double()
    theirs_state = theirs.state_dict()
    assert list(ours.state_dict()) == list(theirs_state)
    for (key, p), (_, q) in zip(ours.state_dict().items(), theirs_state.items()):
        assert p.shape == tuple(q.shape), key
    ours.load_state_dict({k: hg.tensor(v.numpy().copy()) for k, v in theirs_state.items()})
    outs, grad, state_grads = _run(ours, "hg", x, states)
    want, want_grad, want_state_grads = _run(theirs, "torch", x, states)
    assert len(outs) == len(want)
    for o, w in zip(outs, want):
        assert o.shape == w.shape
        np.testing.assert_allclose(o, w, rtol=rtol, atol=atol)
    np.testing.assert_allclose(grad, want_grad, rtol=rtol, atol=atol)
    for g, w in zip(state_grads, want_state_grads):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    theirs_params = dict(theirs.named_parameters())
    for key, p in ours.named_parameters():
        np.testing.assert_allclose(_np(p.grad), _np(theirs_params[key].grad), rtol=rtol,
                                   atol=atol, err_msg=key)


RNG = np.random.default_rng(0)
IN, HID, T, N = 3, 4, 5, 2


def _x(*shape):
    return RNG.standard_normal(shape)


def _h(layers, dirs, batch, size=HID):
    return _x(layers * dirs, batch, size) if batch else _x(layers * dirs, size)


SEQ_CASES = []
for _name in ("RNN", "LSTM", "GRU"):
    for layers in (1, 2):
        for bidir in (False, True):
            SEQ_CASES.append((_name, dict(num_layers=layers, bidirectional=bidir), False, True))
    SEQ_CASES += [(_name, dict(batch_first=True, num_layers=2), False, True),
                  (_name, dict(bias=False, bidirectional=True), False, True),
                  (_name, dict(num_layers=2, bidirectional=True), True, True),   # unbatched
                  (_name, dict(num_layers=2, bidirectional=True, batch_first=True), True, False),
                  (_name, dict(), False, False)]
SEQ_CASES.append(("RNN", dict(nonlinearity="relu", num_layers=2, bidirectional=True), False,
                  True))
SEQ_CASES.append(("LSTM", dict(proj_size=2, num_layers=2, bidirectional=True), False, True))
SEQ_CASES.append(("LSTM", dict(proj_size=3, batch_first=True), True, False))


@pytest.mark.parametrize("name,kwargs,unbatched,given_h0", SEQ_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'unbatched' if c[2] else 'batched'}-"
                              f"{'h0' if c[3] else 'noh0'}" for c in SEQ_CASES])
def test_sequence_layers_match_torch(name, kwargs, unbatched, given_h0):
    layers, dirs = kwargs.get("num_layers", 1), 2 if kwargs.get("bidirectional") else 1
    batch = None if unbatched else N
    if unbatched:
        x = _x(T, IN)
    else:
        x = _x(N, T, IN) if kwargs.get("batch_first") else _x(T, N, IN)
    states = None
    if given_h0:
        proj = kwargs.get("proj_size", 0) or HID
        states = [_h(layers, dirs, batch, proj)]
        if name == "LSTM":
            states.append(_h(layers, dirs, batch))
    compare(name, (IN, HID), kwargs, x, states)


CELL_CASES = [(cell, kw, unb, h0) for cell in ("RNNCell", "LSTMCell", "GRUCell")
              for kw in ({}, {"bias": False}) for unb in (False, True) for h0 in (False, True)]
CELL_CASES.append(("RNNCell", {"nonlinearity": "relu"}, False, True))


@pytest.mark.parametrize("name,kwargs,unbatched,given_h0", CELL_CASES)
def test_cells_match_torch(name, kwargs, unbatched, given_h0):
    x = _x(IN) if unbatched else _x(N, IN)
    states = None
    if given_h0:
        states = [_x(HID) if unbatched else _x(N, HID)]
        if name == "LSTMCell":
            states.append(_x(HID) if unbatched else _x(N, HID))
    compare(name, (IN, HID), kwargs, x, states)


def test_initialisation_is_uniform_within_one_over_sqrt_hidden():
    hg.manual_seed(0)
    m = hnn.LSTM(3, 16, num_layers=2, bidirectional=True)
    values = np.concatenate([_np(p).ravel() for p in m.parameters()])
    assert values.min() >= -0.25 and values.max() <= 0.25
    assert values.min() < -0.2 and values.max() > 0.2  # spread over the range, not zeros
    cell = hnn.GRUCell(3, 4)
    assert all(np.abs(_np(p)).max() <= 0.5 for p in cell.parameters())
    assert np.std(values) == pytest.approx(0.25 / np.sqrt(3), rel=0.1)


def test_positional_arguments_as_torch():
    m = hnn.RNN(3, 4, 2, "relu", False, True)
    assert (m.num_layers, m.nonlinearity, m.bias, m.batch_first) == (2, "relu", False, True)
    assert repr(m) == repr(torch.nn.RNN(3, 4, 2, "relu", False, True))
    assert repr(hnn.LSTM(3, 4, 2, True, True, 0.5, True)) == \
        repr(torch.nn.LSTM(3, 4, 2, True, True, 0.5, True))


def test_dropout_between_layers_only_while_training():
    hg.manual_seed(0)
    m = hnn.GRU(3, 4, num_layers=2, dropout=0.5).double()
    x = hg.tensor(_x(T, N, 3))
    m.eval()
    first = _np(m(x)[0])
    np.testing.assert_array_equal(_np(m(x)[0]), first)
    m.train()
    assert not np.allclose(_np(m(x)[0]), first)
    with pytest.warns(UserWarning, match="non-zero dropout expects num_layers greater than 1"):
        hnn.LSTM(3, 4, dropout=0.2)


def test_dropout_eval_matches_torch():
    ours = hnn.LSTM(3, 4, num_layers=2, dropout=0.3).double().eval()
    theirs = torch.nn.LSTM(3, 4, num_layers=2, dropout=0.3).double().eval()
    ours.load_state_dict({k: hg.tensor(v.numpy().copy()) for k, v in
                          theirs.state_dict().items()})
    x = _x(T, N, 3)
    np.testing.assert_allclose(_np(ours(hg.tensor(x))[0]),
                               _np(theirs(torch.from_numpy(x))[0]), rtol=1e-10)


@pytest.mark.parametrize("call,match", [
    (lambda: hnn.LSTM(3, 4)(hg.tensor(np.zeros((5, 2, 3, 1), np.float32))),
     "LSTM: Expected input to be 2D or 3D, got 4D instead"),
    (lambda: hnn.RNN(3, 4)(hg.tensor(np.zeros(5, np.float32))),
     "RNN: Expected input to be 2D or 3D, got 1D tensor instead"),
    (lambda: hnn.GRU(3, 4)(hg.tensor(np.zeros((5, 2, 2), np.float32))),
     "input.size\\(-1\\) must be equal to input_size. Expected 3, got 2"),
    (lambda: hnn.GRU(3, 4)(hg.tensor(np.zeros((5, 2, 3), np.float32)),
                           hg.tensor(np.zeros((2, 2, 4), np.float32))),
     "Expected hidden size \\(1, 2, 4\\), got \\[2, 2, 4\\]"),
    (lambda: hnn.RNN(3, 4)(hg.tensor(np.zeros((5, 3), np.float32)),
                           hg.tensor(np.zeros((1, 1, 4), np.float32))),
     "For unbatched 2-D input, hx should also be 2-D but got 3-D tensor"),
    (lambda: hnn.LSTM(3, 4)(hg.tensor(np.zeros((5, 2, 3), np.float32)),
                            (hg.tensor(np.zeros((1, 2, 4), np.float32)),
                             hg.tensor(np.zeros((1, 3, 4), np.float32)))),
     "Expected hidden\\[1\\] size \\(1, 2, 4\\), got \\[1, 3, 4\\]"),
    (lambda: hnn.LSTM(3, 4)(hg.tensor(np.zeros((5, 2, 3), np.float64))),
     "RNN input dtype \\(float64\\) does not match weight dtype \\(float32\\)"),
    (lambda: hnn.GRUCell(3, 4)(hg.tensor(np.zeros((1, 2, 3), np.float32))),
     "GRUCell: Expected input to be 1D or 2D, got 3D instead"),
    (lambda: hnn.RNN(3, 4, nonlinearity="gelu"), "Unknown nonlinearity 'gelu'"),
    (lambda: hnn.GRU(3, 4, proj_size=2), "proj_size argument is only supported for LSTM"),
    (lambda: hnn.LSTM(3, 4, proj_size=4), "proj_size has to be smaller than hidden_size"),
    (lambda: hnn.LSTM(3, 4, dropout=1.5), "dropout should be a number in range \\[0, 1\\]"),
])
def test_errors_use_torch_wording(call, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, RuntimeError), match=match):
            call()


def test_trains_a_sequence_task():
    """A GRU learns to output the running sum sign; its loss falls as torch's does from the same
    weights, step by step, under plain SGD."""
    ours, theirs = hnn.GRU(2, 8, batch_first=True).double(), \
        torch.nn.GRU(2, 8, batch_first=True).double()
    ours.load_state_dict({k: hg.tensor(v.numpy().copy()) for k, v in
                          theirs.state_dict().items()})
    x = _x(4, 6, 2)
    target = np.tanh(np.cumsum(x[..., :1], 1))
    losses = []
    for model, make in ((ours, hg.tensor), (theirs, torch.from_numpy)):
        trace = []
        for _ in range(5):
            out = model(make(x))[0][..., :1]
            diff = out - make(target)
            loss = (diff * diff).mean()
            loss.backward()
            grad_mode = hg.no_grad() if make is hg.tensor else torch.no_grad()
            with grad_mode:
                for p in model.parameters():
                    p -= 0.5 * p.grad
                    p.grad = None
            trace.append(float(loss.item()))
        losses.append(trace)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-9)
    assert losses[0][-1] < losses[0][0]


# --- packed sequences -----------------------------------------------------------------------
from hpcgrad.nn import _packed as hpack  # noqa: E402  (nn.utils.rnn's functions)

LENGTHS = np.array([3, 5, 1, 4])


def _packed_run(module, lib, x, states, batch_first):
    """Pack x (lengths LENGTHS, unsorted), run, pad the output back; backward of fixed random
    projections of the padded output and the final states."""
    rnn_utils = hpack if lib == "hg" else torch.nn.utils.rnn
    make = hg.tensor if lib == "hg" else torch.from_numpy
    xt = make(x.copy()).requires_grad_(True)
    packed = rnn_utils.pack_padded_sequence(xt, make(LENGTHS.copy()), batch_first=batch_first,
                                            enforce_sorted=False)
    st = None if states is None else [make(s.copy()).requires_grad_(True) for s in states]
    args = (packed,) if st is None else (packed, st[0] if len(st) == 1 else tuple(st))
    out, hidden = module(*args)
    assert type(out).__name__ == "PackedSequence"
    padded, lengths = rnn_utils.pad_packed_sequence(out, batch_first=batch_first)
    np.testing.assert_array_equal(_np(lengths), LENGTHS)
    outs = [padded] + _flat(hidden)
    rng = np.random.default_rng(5)
    total = sum(((o * make(rng.standard_normal(tuple(o.shape)))).sum() for o in outs[1:]),
                (outs[0] * make(rng.standard_normal(tuple(outs[0].shape)))).sum())
    total.backward()
    return ([_np(o) for o in outs], _np(xt.grad),
            [] if st is None else [_np(s.grad) for s in st])


PACKED_CASES = [("RNN", dict(num_layers=2, bidirectional=True), True),
                ("LSTM", dict(num_layers=2, bidirectional=True), True),
                ("LSTM", dict(proj_size=2, batch_first=True), False),
                ("GRU", dict(bidirectional=True, batch_first=True), True),
                ("GRU", dict(num_layers=2), False)]


@pytest.mark.parametrize("name,kwargs,given_h0", PACKED_CASES)
def test_packed_sequences_match_torch(name, kwargs, given_h0):
    batch_first = kwargs.get("batch_first", False)
    x = _x(len(LENGTHS), 5, IN) if batch_first else _x(5, len(LENGTHS), IN)
    layers, dirs = kwargs.get("num_layers", 1), 2 if kwargs.get("bidirectional") else 1
    states = None
    if given_h0:
        states = [_h(layers, dirs, len(LENGTHS), kwargs.get("proj_size", 0) or HID)]
        if name == "LSTM":
            states.append(_h(layers, dirs, len(LENGTHS)))
    ours = getattr(hnn, name)(IN, HID, **kwargs).double()
    theirs = getattr(torch.nn, name)(IN, HID, **kwargs).double()
    ours.load_state_dict({k: hg.tensor(v.numpy().copy()) for k, v in
                          theirs.state_dict().items()})
    got = _packed_run(ours, "hg", x, states, batch_first)
    want = _packed_run(theirs, "torch", x, states, batch_first)
    for g, w in zip(got[0] + [got[1]] + got[2], want[0] + [want[1]] + want[2]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    theirs_params = dict(theirs.named_parameters())
    for key, p in ours.named_parameters():
        np.testing.assert_allclose(_np(p.grad), _np(theirs_params[key].grad), rtol=1e-10,
                                   atol=1e-12, err_msg=key)


def test_pack_and_pad_helpers_match_torch():
    seqs = [_x(n, 2) for n in (4, 2, 3)]
    ours = hpack.pack_sequence([hg.tensor(s) for s in seqs], enforce_sorted=False)
    theirs = torch.nn.utils.rnn.pack_sequence([torch.from_numpy(s) for s in seqs],
                                              enforce_sorted=False)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(_np(a), _np(b))
    padded, lengths = hpack.pad_packed_sequence(ours, batch_first=True, padding_value=-1.0,
                                                total_length=6)
    want, want_lengths = torch.nn.utils.rnn.pad_packed_sequence(
        theirs, batch_first=True, padding_value=-1.0, total_length=6)
    np.testing.assert_array_equal(_np(padded), _np(want))
    np.testing.assert_array_equal(_np(lengths), _np(want_lengths))
    for side in ("left", "right"):
        np.testing.assert_array_equal(
            _np(hpack.pad_sequence([hg.tensor(s) for s in seqs], True, 9.0, side)),
            _np(torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s) for s in seqs], True, 9.0,
                                                side)))
    with pytest.raises(RuntimeError, match="must be sorted in decreasing order"):
        hpack.pack_sequence([hg.tensor(s) for s in seqs])
