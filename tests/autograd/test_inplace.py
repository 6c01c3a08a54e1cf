"""In-place ops and views: gradchecks (finite differences), and values, gradients, second
derivatives, versions and error messages beside PyTorch CPU (those skip without torch).

Each case is written once against a small adapter (``lib``), so the same code runs on hpcgrad
and on torch. The in-place op is applied to a non-leaf (``x * 1``), so both the written tensor's
old graph and the op's other operands get gradients.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad, gradcheck, gradgradcheck, no_grad

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="compares with PyTorch (not installed)")

HG = SimpleNamespace(name="hpcgrad", tensor=lambda a, rg=False: hg.tensor(a, requires_grad=rg),
                     grad=grad, no_grad=no_grad, relu=hg.nn.ReLU, F=hg.nn.functional)
if torch is not None:
    TORCH = SimpleNamespace(name="torch", tensor=lambda a, rg=False: torch.tensor(a, requires_grad=rg),
                            grad=torch.autograd.grad, no_grad=torch.no_grad, relu=torch.nn.ReLU,
                            F=torch.nn.functional)


def _numpy(t):
    return t.detach().numpy() if torch is not None and isinstance(t, torch.Tensor) else t.data


def _run(lib, fn, arrays, seed):
    """Output, gradients for a random upstream gradient v, and the gradient of <grads, w>."""
    xs = [lib.tensor(a.copy(), True) for a in arrays]
    out = fn(lib, *xs)
    rng = np.random.default_rng(seed)
    v = lib.tensor(rng.standard_normal(tuple(out.shape)))
    grads = lib.grad(out, xs, v, create_graph=True, allow_unused=True)
    grads = [lib.tensor(np.zeros(a.shape)) if g is None else g for a, g in zip(arrays, grads)]
    total = sum((g * lib.tensor(rng.standard_normal(tuple(g.shape)))).sum() for g in grads)
    second = (lib.grad(total, xs, allow_unused=True) if total.requires_grad
              else [None] * len(xs))
    second = [np.zeros(a.shape) if s is None else _numpy(s) for a, s in zip(arrays, second)]
    return _numpy(out), [_numpy(g) for g in grads], second


def compare(fn, *arrays, seed=0):
    """fn(lib, *tensors) on hpcgrad and on torch: same values, gradients, second derivatives."""
    got = _run(HG, fn, arrays, seed)
    want = _run(TORCH, fn, arrays, seed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
    for g, w in zip(got[1] + got[2], want[1] + want[2]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3))
Y = RNG.standard_normal((2, 3))
POS = RNG.random((2, 3)) + 0.5
ROW = RNG.standard_normal(3)
MASK = np.array([[True, False, True], [False, False, True]])

# name -> (fn(lib, x, y), arrays): x is written in place (through x * 1), y is the operand
CASES = {
    "add_": (lambda L, x, y: (x * 1).add_(y), (X, Y)),
    "add_alpha": (lambda L, x, y: (x * 1).add_(y, alpha=2.5), (X, Y)),
    "sub_alpha": (lambda L, x, y: (x * 1).sub_(y, alpha=0.5), (X, Y)),
    "mul_": (lambda L, x, y: (x * 1).mul_(y), (X, Y)),
    "mul_broadcast": (lambda L, x, y: (x * 1).mul_(y), (X, ROW)),
    "mul_scalar": (lambda L, x, y: (x * y).mul_(3.0), (X, Y)),
    "mul_self": (lambda L, x, y: (x * y).mul_(x * y), (X, Y)),
    "div_": (lambda L, x, y: (x * 1).div_(y), (X, POS)),
    "pow_scalar": (lambda L, x, y: (x * y).pow_(2.5), (POS, POS)),
    "pow_tensor": (lambda L, x, y: (x * 1).pow_(y), (POS, Y)),
    "neg_": (lambda L, x, y: (x * y).neg_(), (X, Y)),
    "exp_": (lambda L, x, y: (x * y).exp_(), (X, Y)),
    "log_": (lambda L, x, y: (x * y).log_(), (POS, POS)),
    "sqrt_": (lambda L, x, y: (x * y).sqrt_(), (POS, POS)),
    "tanh_": (lambda L, x, y: (x * y).tanh_(), (X, Y)),
    "sigmoid_": (lambda L, x, y: (x * y).sigmoid_(), (X, Y)),
    "relu_": (lambda L, x, y: (x * y).relu_(), (X, Y)),
    "sin_": (lambda L, x, y: (x * y).sin_(), (X, Y)),
    "clamp_": (lambda L, x, y: (x * y).clamp_(-0.3, 0.4), (X, Y)),
    "clamp_min_": (lambda L, x, y: (x * y).clamp_min_(0.1), (X, Y)),
    "zero_": (lambda L, x, y: (x * y).zero_() + x, (X, Y)),
    "fill_tensor": (lambda L, x, y: (x * 1).fill_(y.sum()), (X, Y)),
    "copy_": (lambda L, x, y: (x * 2).copy_(y), (X, Y)),
    "copy_broadcast": (lambda L, x, y: (x * 2).copy_(y), (X, ROW)),
    "masked_fill_": (lambda L, x, y: (x * 2).masked_fill_(L.tensor(MASK), y.sum()), (X, Y)),
    "iadd_then_use": (lambda L, x, y: _iops(x * 1, y), (X, POS)),
    "setitem_slice": (lambda L, x, y: _setitem(x * 1, (slice(None), slice(1, 3)), y[:, :2] * 3),
                      (X, Y)),
    "setitem_int": (lambda L, x, y: _setitem(x * 1, 1, y[0]), (X, Y)),
    "setitem_number": (lambda L, x, y: _setitem(x * y, (0, 2), 7.0), (X, Y)),
    "setitem_array": (lambda L, x, y: _setitem(x * 1, (L.tensor([1, 0]), L.tensor([2, 1])),
                                              y[0, :2]), (X, Y)),
    "setitem_mask": (lambda L, x, y: _setitem(x * 1, L.tensor(MASK), y[L.tensor(MASK)] * 2),
                     (X, Y)),
    "view_mul_": (lambda L, x, y: _then_base(x * 1, lambda b: b.narrow(1, 1, 2).mul_(y[:, :2])),
                  (X, Y)),
    "view_of_view": (lambda L, x, y: _then_base(x * 1, lambda b: b[1][1:].mul_(y[0, :2])),
                     (X, Y)),
    "transposed_view": (lambda L, x, y: _then_base(x * 1, lambda b: b.t().add_(y.t() * y.t())),
                        (X, Y)),
    "reshaped_view": (lambda L, x, y: _then_base(x * 1, lambda b: b.view(6).exp_()), (X, Y)),
    "view_backprop_view": (lambda L, x, y: (x * 1).narrow(0, 1, 1).mul_(y[1:]), (X, Y)),
    "base_then_view": (lambda L, x, y: _base_then_view(x * 1, y), (X, Y)),
    "relu_module": (lambda L, x, y: L.relu(inplace=True)((x * y).view(3, 2)), (X, Y)),
    "relu_functional": (lambda L, x, y: L.F.relu(x * y, inplace=True), (X, Y)),
}


def _iops(t, y):
    t += y
    t *= y
    t -= 1.5
    t /= y
    return t


def _setitem(t, index, value):
    t[index] = value
    return t


def _then_base(base, write):
    write(base)
    return base * 1


def _base_then_view(base, y):
    view = base[0]
    base.mul_(y)  # the view made before leads through the write
    return view * 2


@needs_torch
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_torch(name):
    fn, arrays = CASES[name]
    compare(fn, *arrays)


@pytest.mark.parametrize("name", ["add_alpha", "mul_self", "div_", "pow_tensor", "exp_", "relu_",
                                  "copy_broadcast", "masked_fill_", "setitem_array",
                                  "setitem_mask", "view_mul_", "view_of_view", "base_then_view",
                                  "fill_tensor"])
def test_gradcheck(name):
    fn, arrays = CASES[name]
    inputs = [hg.tensor(a.copy(), requires_grad=True) for a in arrays]
    assert gradcheck(lambda *xs: fn(HG, *xs), inputs)
    assert gradgradcheck(lambda *xs: fn(HG, *xs), inputs)


def _versions(lib):
    """The version after each write of a sequence, PyTorch's counting."""
    x = lib.tensor(np.zeros((3, 4)))
    v = x[1]
    seen = []
    for write in (lambda: x.add_(1), lambda: x.mul_(2), lambda: x.__setitem__(0, 1.0),
                  lambda: v.add_(1), lambda: x.zero_(), lambda: x.fill_(2.0),
                  lambda: x.copy_(lib.tensor(np.ones((3, 4)))),
                  lambda: x.masked_fill_(lib.tensor(np.eye(3, 4, dtype=bool)), 0.5),
                  lambda: x.relu_(), lambda: x.__setitem__(lib.tensor(np.eye(3, 4) > 0), 3.0),
                  lambda: x.t().clamp_(0, 1), lambda: v.exp_()):
        write()
        seen.append((x._version, v._version))
    return seen


@needs_torch
def test_versions_match_torch():
    assert _versions(HG) == _versions(TORCH)


def _errors(lib):
    """The messages of the refused writes."""
    messages = []

    def catch(fn):
        try:
            fn()
        except RuntimeError as error:
            messages.append(str(error).split(" (")[0].split(". Hint")[0])
        else:
            messages.append(None)

    leaf = lib.tensor(np.ones(3), True)
    catch(lambda: leaf.add_(1))
    catch(lambda: leaf.view(3).mul_(2))
    catch(lambda: lib.tensor(np.ones(3)).add_(lib.tensor(np.ones((2, 3)))))
    catch(lambda: lib.tensor(np.ones(3, dtype=np.int64)).mul_(lib.tensor(np.ones(3))))
    a = leaf * 1
    b = a.sigmoid()
    b.add_(1)
    catch(lambda: b.sum().backward())
    return messages


@needs_torch
def test_error_messages_match_torch():
    got, want = _errors(HG), _errors(TORCH)
    assert got[:4] == want[:4]
    # dtype and node names differ (float64 vs torch.DoubleTensor; torch 2.13 names the forward
    # op here); the output number, versions and wording agree
    assert got[4].replace("float64", "torch.DoubleTensor").replace(
        "SigmoidBackward0", "Sigmoid") == want[4]


def test_errors_without_torch():
    got = _errors(HG)
    assert got[0] == "a leaf Variable that requires grad is being used in an in-place operation."
    assert got[1] == ("a view of a leaf Variable that requires grad is being used in an in-place "
                      "operation.")
    assert got[2] == "output with shape [3] doesn't match the broadcast shape [2, 3]"
    assert got[3] == "result type Double can't be cast to the desired output type Long"
    assert got[4] == ("one of the variables needed for gradient computation has been modified by "
                      "an inplace operation: [float64 [3]], which is output 0 of "
                      "SigmoidBackward0, is at version 1; expected version 0 instead")


def test_expanded_view_write_refused():
    x = hg.tensor(np.ones((1, 3)))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        x.expand(4, 3).add_(1)


def test_inplace_returns_self_and_keeps_memory():
    x = hg.tensor(np.arange(6.0).reshape(2, 3))
    data = x.array
    view = x[0]
    for out in (x.add_(1), x.mul_(2), x.relu_(), x.clamp_(0, 5), x.copy_(hg.tensor(np.ones(3)))):
        assert out is x and x.array is data
    assert np.array_equal(view.array, np.ones(3))


def test_no_grad_writes_like_an_optimizer_step():
    """Under no_grad a parameter is written in place, keeps being a leaf, and backward still
    works on graphs built after the write."""
    p = hg.tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    (p * p).sum().backward()
    with no_grad():
        p.add_(p.grad, alpha=-0.1)
    np.testing.assert_allclose(p.array, [0.8, -1.6, 2.4])
    assert p.is_leaf and p._version == 1
    p.grad = None
    (p * 2).sum().backward()
    np.testing.assert_allclose(p.grad.array, [2.0, 2.0, 2.0])


def test_dropout_inplace_is_the_same_mask():
    """F.dropout(inplace=True) writes the out-of-place result (same seed) into its input."""
    x = hg.tensor(np.random.default_rng(0).standard_normal((4, 5)), requires_grad=True)
    hg.manual_seed(3)
    want = hg.nn.functional.dropout(x * 1, 0.4)
    hg.manual_seed(3)
    y = x * 1
    out = hg.nn.Dropout(0.4, inplace=True)(y)
    assert out is y and y._version == 1
    np.testing.assert_array_equal(out.array, want.array)
    out.sum().backward()
    scale = np.where(want.array != 0, 1 / 0.6, 0.0)
    np.testing.assert_allclose(x.grad.array, scale)


def test_relu_module_inplace_flag():
    y = hg.tensor(np.array([-1.0, 2.0]))
    assert hg.nn.ReLU(inplace=True)(y) is y
    assert np.array_equal(y.array, [0.0, 2.0])
    z = hg.tensor(np.array([-1.0, 2.0]))
    assert hg.nn.ReLU()(z) is not z and z.array[0] == -1.0
