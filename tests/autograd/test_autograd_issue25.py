"""Defects found from outside (issue 25) in hooks, saved tensors, custom Functions and leaves, each against PyTorch."""

import warnings

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd.function import Function


def _leaf(values=(1.0, 2.0, 3.0), dtype=np.float32):
    return hg.tensor(np.array(values, dtype), requires_grad=True)


def _raises_like_torch(run_hg, run_torch, match):
    """Both libraries raise, with the same words (PyTorch's message as the reference)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match=match) as theirs:
        run_torch(torch)
    with pytest.raises(RuntimeError, match=match):
        run_hg()
    return theirs


@pytest.mark.parametrize("hook, words", [
    (lambda g: g.sum(), "has changed the size of value"),
    (lambda g: g.double() if hasattr(g, "double") else g.to(np.float64),
     "has changed the type of value"),
])
def test_tensor_hook_may_not_change_size_or_type(hook, words):
    def run_torch(torch):
        y = torch.ones(3, requires_grad=True) * 2
        y.register_hook(hook)
        y.sum().backward()

    def run_hg():
        y = _leaf() * 2
        y.register_hook(hook)
        y.sum().backward()

    _raises_like_torch(run_hg, run_torch, f"hook '<lambda>' {words}")


def test_tensor_hook_on_a_leaf_is_checked_too():
    x = _leaf()
    x.register_hook(lambda g: g[:2])
    with pytest.raises(RuntimeError, match="has changed the size of value"):
        (x * 2).sum().backward()
    assert x.grad is None


def test_pack_hook_that_writes_its_input_in_place_is_refused():
    def pack(t):
        t.add_(1)
        return t

    def run_torch(torch):
        a = torch.ones(3, requires_grad=True)
        b = a * 1  # a non-leaf: a leaf would refuse the in-place write for its own reason
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (b * b).sum()

    def run_hg():
        b = _leaf() * 1
        with hg.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (b * b).sum()

    _raises_like_torch(run_hg, run_torch, "A saved tensor pack hook is modifying its input "
                                          "in place")


def test_pack_hook_that_copies_is_fine():
    b = _leaf() * 1
    with hg.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
        y = (b * b).sum()
    np.testing.assert_allclose(y.item(), 14.0)


class _DirtyOther(Function):
    @staticmethod
    def forward(ctx, a):
        b = hg.tensor(np.ones(3, np.float32))
        ctx.mark_dirty(b)
        return b

    @staticmethod
    def backward(ctx, g):
        return g


def test_mark_dirty_of_a_tensor_that_is_not_an_input_warns_as_torch():
    torch = pytest.importorskip("torch")

    class TorchDirtyOther(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            b = torch.ones(3)
            ctx.mark_dirty(b)
            return b

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.warns(UserWarning, match="ctx.mark_dirty.. received a tensor that was not an "
                                         "input"):
        TorchDirtyOther.apply(torch.ones(3, requires_grad=True))
    with pytest.warns(UserWarning, match="ctx.mark_dirty.. received a tensor that was not an "
                                         "input"):
        _DirtyOther.apply(_leaf())


def test_detect_anomaly_warns_when_enabled_as_torch():
    torch = pytest.importorskip("torch")
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled") as theirs:
        with torch.autograd.detect_anomaly():
            pass
    with pytest.warns(UserWarning) as ours:
        with hg.autograd.detect_anomaly():
            pass
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]


def test_leaf_that_stops_requiring_grad_before_backward_gets_no_grad():
    torch = pytest.importorskip("torch")
    t = torch.ones(2, requires_grad=True)
    loss = (t * 2).sum()
    t.requires_grad_(False)
    loss.backward()
    x = _leaf((1.0, 1.0))
    loss = (x * 2).sum()
    x.requires_grad_(False)
    loss.backward()
    assert t.grad is None and x.grad is None


@pytest.mark.parametrize("make, torch_make", [
    (lambda x: x.unbind(0)[0], lambda x: x.unbind(0)[0]),
    (lambda x: x * 2, lambda x: x * 2),
    (lambda x: x.chunk(3)[1], lambda x: x.chunk(3)[1]),
    (lambda x: x.sum(), lambda x: x.sum()),
])
def test_builtin_node_names_carry_torch_numeric_suffix(make, torch_make):
    torch = pytest.importorskip("torch")
    ours = make(_leaf()).grad_fn.name()
    theirs = torch_make(torch.ones(3, requires_grad=True)).grad_fn.name()
    assert ours.endswith("Backward0") and theirs.endswith("Backward0")
    assert ours.lower().replace("_", "") == theirs.lower().replace("_", "")


def test_custom_function_node_names_have_no_suffix():
    class Mine(Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1

        @staticmethod
        def backward(ctx, g):
            return g

    assert Mine.apply(_leaf()).grad_fn.name() == "MineBackward"  # as PyTorch's Python Functions


def test_no_warning_from_mark_dirty_of_an_input():
    class Inplace(Function):
        @staticmethod
        def forward(ctx, a):
            a._data += 1  # noqa: a forward that writes its input, as PyTorch's examples do
            ctx.mark_dirty(a)
            return a

        @staticmethod
        def backward(ctx, g):
            return g

    x = _leaf() * 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = Inplace.apply(x)
    assert y is x
