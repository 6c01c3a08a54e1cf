"""Ports of PyTorch's TestAutograd engine tests (test_a*..test_l*): anomaly mode, deep reentrancy.

Left out (hpcgrad does not build them): Node.metadata dicts (test_anomaly_assign_parent_cleanup),
anomaly warnings about in-place modification (test_anomaly_grad_warnings), nested tensors
(test_calculate_shape_util).
"""

import sys
import warnings

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, detect_anomaly

import autograd_al_helpers as a

close = a.close

_SIZE = 10


class MyFunc(Function):
    """PyTorch's MyFunc of test_anomaly_detect_nan: backward puts a nan at index 0 of the
    gradient of one input (``gI[0] = 0; gI[0] /= 0`` written without in-place ops)."""

    @staticmethod
    def forward(ctx, inp1, inp2, fail_0th):
        ctx.fail_0th = fail_0th
        return inp1.sum(0, keepdim=True)

    @staticmethod
    def backward(ctx, gO):
        nan_first = np.ones(_SIZE)
        nan_first[0] = np.nan
        gI = gO.expand(_SIZE) * hg.tensor(nan_first)
        return (gI, None, None) if ctx.fail_0th else (None, gI, None)


def _reported(ws, captured):
    """What anomaly mode told the user: warnings (PyTorch) and stderr (hpcgrad prints the stack)."""
    return "\n".join(str(w.message) for w in ws) + captured.err


def test_anomaly_detect_nan(capsys):
    inp = a.rand(_SIZE, requires_grad=True)
    out = MyFunc.apply(inp, inp, True)
    out.backward()  # without anomaly mode a nan is not an error

    inp = a.rand(_SIZE, requires_grad=True)
    out = MyFunc.apply(inp, inp, True)
    with pytest.raises(RuntimeError,
                       match="Function 'MyFuncBackward' returned nan values in its 0th output."):
        with detect_anomaly():
            out.backward()

    inp = a.rand(_SIZE, requires_grad=True)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="Function 'MyFuncBackward' returned nan values "
                                               "in its 1th output."):
            with detect_anomaly():
                out = MyFunc.apply(inp, inp, False)
                out.backward()
    # the forward call that built the failing Node is shown (forward ran under anomaly mode)
    assert "MyFunc.apply(inp, inp, False)" in _reported(ws, capsys.readouterr())


def test_anomaly_detect_nan_no_forward_information(capsys):
    # the middle case of PyTorch's test_anomaly_detect_nan: forward ran without anomaly mode
    inp = a.rand(_SIZE, requires_grad=True)
    out = MyFunc.apply(inp, inp, True)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="returned nan values in its 0th output"):
            with detect_anomaly():
                out.backward()
    assert "No forward pass information" in _reported(ws, capsys.readouterr())


def test_anomaly_mode_no_check_nan():
    class MyFunc(Function):  # noqa: F811 (PyTorch's name: the error names it)
        @staticmethod
        def forward(ctx, inp):
            return inp.clone()

        @staticmethod
        def backward(ctx, gO):
            return hg.tensor(np.float64(np.nan)).expand(10, 10)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with detect_anomaly(check_nan=False):
            inp = a.rand(10, 10, requires_grad=True)
            out = MyFunc.apply(inp).sum()
            out.backward(retain_graph=True)  # check_nan=False: a nan is let through
            with detect_anomaly(check_nan=True):
                with pytest.raises(RuntimeError, match="Function 'MyFuncBackward' returned nan "
                                                       "values in its 0th output."):
                    out.backward(retain_graph=True)
            out.backward()  # the outer setting is back
    assert np.isnan(a.arr(inp.grad)).all()


class _DeepReentrant(Function):
    """Each backward runs a new backward through a fresh graph, until the counter is below 0."""

    @staticmethod
    def forward(ctx, x):
        with hg.enable_grad():
            ctx.x = x.detach().requires_grad_(True) - 1
        return ctx.x.detach()

    @staticmethod
    def backward(ctx, x):
        if ctx.x.item() < 0:
            return x
        with hg.enable_grad():
            _DeepReentrant.apply(ctx.x).sum().backward()
        return x


def test_deep_reentrant():
    # 2000 nested backwards, as in PyTorch: past the depth where the engine hands reentrant
    # work to a pool thread, so no thread's stack (nor Python's recursion limit) overflows.
    assert 2000 > sys.getrecursionlimit() // 10
    v = a.t(2000.0, requires_grad=True)
    _DeepReentrant.apply(v).sum().backward()
    close(v.grad, 1.0)
    # a second time, reusing the pool's threads
    v2 = a.t(200.0, requires_grad=True)
    _DeepReentrant.apply(v2).sum().backward()
    close(v2.grad, 1.0)
