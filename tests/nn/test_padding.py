"""F.pad's reflect, replicate and circular modes, the padding layers and Conv's padding_mode
(nn/_padding.py): hand-computed values and gradients, gradcheck in float64, the errors, and
PyTorch's results on random shapes, amounts and convolutions."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck

ROW = np.arange(4.0).reshape(1, 1, 4)  # [0, 1, 2, 3]

# (mode, (left, right), the padded row, the gradient of its sum): written out by hand
HAND = [
    ("reflect", (1, 2), [1, 0, 1, 2, 3, 2, 1], [1, 3, 2, 1]),
    ("reflect", (3, 0), [3, 2, 1, 0, 1, 2, 3], [1, 2, 2, 2]),
    ("reflect", (-1, 2), [1, 2, 3, 2, 1], [0, 2, 2, 1]),
    ("reflect", (2, -1), [2, 1, 0, 1, 2], [1, 2, 2, 0]),
    ("replicate", (2, 1), [0, 0, 0, 1, 2, 3, 3], [3, 1, 1, 2]),
    ("replicate", (5, 0), [0, 0, 0, 0, 0, 0, 1, 2, 3], [6, 1, 1, 1]),
    ("replicate", (-4, 1), [3], [0, 0, 0, 1]),
    ("circular", (1, 2), [3, 0, 1, 2, 3, 0, 1], [2, 2, 1, 2]),
    ("circular", (4, 0), [0, 1, 2, 3, 0, 1, 2, 3], [2, 2, 2, 2]),
    ("circular", (-1, 2), [1, 2, 3, 1, 2], [0, 2, 2, 1]),  # wraps around what is left
    ("circular", (2, -1), [1, 2, 0, 1, 2], [1, 2, 2, 0]),
]


@pytest.mark.parametrize("mode, amounts, padded, grad", HAND,
                         ids=[f"{m}{a}" for m, a, _, _ in HAND])
def test_pad_by_hand(mode, amounts, padded, grad):
    x = hg.tensor(ROW.copy(), requires_grad=True)
    out = F.pad(x, amounts, mode=mode)
    out.sum().backward()
    np.testing.assert_array_equal(out.detach().numpy()[0, 0], padded)
    np.testing.assert_array_equal(x.grad.numpy()[0, 0], grad)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("shape, amounts", [
    ((2, 3, 5), (2, 1)),
    ((3, 4, 5), (1, 2, 2, 0)),
    ((2, 3, 4, 5), (0, 2, -1, 1)),
    ((2, 2, 3, 3, 4), (1, 1, 2, 0, 1, 2)),
])
def test_pad_gradcheck(mode, shape, amounts):
    x = hg.tensor(np.random.default_rng(1).standard_normal(shape), requires_grad=True)
    assert gradcheck(lambda t: F.pad(t, amounts, mode=mode), (x,))
    assert gradgradcheck(lambda t: F.pad(t, amounts, mode=mode) ** 2, (x,))


def test_pad_returns_a_new_tensor_without_amounts():
    x = hg.tensor(ROW.copy(), requires_grad=True)
    out = F.pad(x, (0, 0), mode="reflect")
    out.add_(1.0)
    np.testing.assert_array_equal(x.detach().numpy(), ROW)


@pytest.mark.parametrize("shape, amounts, kwargs, error, words", [
    ((4,), (1, 1), {"mode": "reflect"}, NotImplementedError, "last 1, 2 or 3 dimensions"),
    ((1, 1, 3, 4), (1, 1), {"mode": "replicate"}, NotImplementedError, "2 padding values for a 4-D"),
    ((3, 4), (1, 1, 1, 1), {"mode": "circular"}, NotImplementedError, "4 padding values for a 2-D"),
    ((1, 3, 4), (4, 0), {"mode": "reflect"}, RuntimeError, "must be less than its size 4"),
    ((1, 3, 4), (5, 0), {"mode": "circular"}, RuntimeError, "wrapping around more than once"),
    ((1, 3, 4), (-3, -1), {"mode": "replicate"}, RuntimeError, "would have \\[0\\] elements"),
    ((2, 3), (-2, -2), {}, RuntimeError, "crops more than the 3 elements of dimension 1"),
    ((2, 3), (1, 1, -3, 0), {}, RuntimeError, "crops more than the 2 elements of dimension 0"),
    ((1, 0, 4), (1, 1), {"mode": "reflect"}, RuntimeError, "every dimension but the first"),
    ((1, 3, 4), (1, 1), {"mode": "reflect", "value": 1.0}, RuntimeError, "value argument"),
    ((1, 3, 4), (1, 1), {"mode": "wrap"}, NotImplementedError, "unrecognised padding mode 'wrap'"),
    ((1, 3, 4), (1, 1, 1), {"mode": "reflect"}, ValueError, "divisible by 2"),
])
def test_pad_errors(shape, amounts, kwargs, error, words):
    with pytest.raises(error, match=words):
        F.pad(hg.ones(*shape), amounts, **kwargs)


def test_pad_accepts_value_zero_and_none_as_pytorch():
    x = hg.tensor(ROW.copy())
    for value in (0, 0.0, None):
        np.testing.assert_array_equal(F.pad(x, (1, 1), mode="reflect", value=value).numpy(),
                                      [[[1, 0, 1, 2, 3, 2]]])
    np.testing.assert_array_equal(F.pad(x, (1, 0)).numpy(), [[[0, 0, 1, 2, 3]]])


@pytest.mark.parametrize("layer, amounts, text", [
    (nn.ReflectionPad2d(1), (1, 1, 1, 1), "ReflectionPad2d((1, 1, 1, 1))"),
    (nn.CircularPad1d((1, 2)), (1, 2), "CircularPad1d((1, 2))"),
    (nn.ReplicationPad3d(1), (1,) * 6, "ReplicationPad3d((1, 1, 1, 1, 1, 1))"),
    (nn.ZeroPad2d((0, 1, 2, 3)), (0, 1, 2, 3), "ZeroPad2d((0, 1, 2, 3))"),
    (nn.ConstantPad1d(2, 3.5), (2, 2), "ConstantPad1d(padding=(2, 2), value=3.5)"),
])
def test_padding_layers(layer, amounts, text):
    assert layer.padding == amounts and repr(layer) == text
    x = hg.tensor(np.random.default_rng(2).standard_normal((2, 3, 4, 5, 6)[:len(amounts) // 2 + 2]))
    mode = getattr(layer, "mode", "constant")
    value = getattr(layer, "value", None)
    np.testing.assert_array_equal(layer(x).numpy(), F.pad(x, amounts, mode, value).numpy())


def test_padding_layer_amounts_are_checked():
    with pytest.raises(ValueError, match="ReflectionPad2d: padding must be an int or a 4-tuple"):
        nn.ReflectionPad2d((1, 2))


def test_conv_padding_mode_is_pad_then_convolve():
    """Conv2d(padding_mode='circular') equals F.pad(circular) then a convolution without
    padding, written out: a periodic boundary, as a physics model uses it."""
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular", bias=False).double()
    x = hg.tensor(np.random.default_rng(3).standard_normal((2, 2, 5, 6)), requires_grad=True)
    expected = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), conv.weight)
    np.testing.assert_allclose(conv(x).detach().numpy(), expected.detach().numpy(), rtol=1e-12)
    assert "padding_mode=circular" in repr(conv)
    assert gradcheck(lambda t, w: F.conv2d(F.pad(t, (1, 1, 1, 1), mode="circular"), w),
                     (x, conv.weight))


def test_conv_padding_mode_errors():
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        nn.Conv2d(2, 2, 3, padding_mode="bogus")
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
    with pytest.raises(RuntimeError, match="must be less than its size 3"):
        nn.Conv2d(2, 2, 3, padding=3, padding_mode="reflect")(hg.ones(1, 2, 3, 3))


def _random_pad(rng):
    dims = int(rng.integers(1, 4))
    batched = rng.random() < 0.7
    shape = ((int(rng.integers(0, 3)),) if batched else ()) + (int(rng.integers(1, 3)),) + tuple(
        int(rng.integers(1, 6)) for _ in range(dims))
    amounts = tuple(int(rng.integers(-2, 5)) for _ in range(2 * dims))
    return shape, amounts, str(rng.choice(["reflect", "replicate", "circular", "constant"]))


def test_pad_against_pytorch():
    """300 random shapes and amounts (negative ones too) in every mode: PyTorch's values and
    gradients, and an error where PyTorch raises one."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    compared = 0
    for _ in range(300):
        shape, amounts, mode = _random_pad(rng)
        x = rng.standard_normal(shape)
        kept = [shape[-1 - k] - max(-amounts[2 * k], 0) - max(-amounts[2 * k + 1], 0)
                for k in range(len(amounts) // 2)]
        if mode == "circular" and any(  # PyTorch's copies overlap, or read what none wrote
                max(amounts[2 * k], amounts[2 * k + 1]) > kept[k] or kept[k] <= 0
                for k in range(len(kept))):
            continue
        tx = torch.tensor(x, requires_grad=True)
        hx = hg.tensor(x, requires_grad=True)
        try:
            expected = torch.nn.functional.pad(tx, amounts, mode=mode)
        except (RuntimeError, NotImplementedError):
            with pytest.raises((RuntimeError, NotImplementedError)):
                F.pad(hx, amounts, mode=mode)
            continue
        out = F.pad(hx, amounts, mode=mode)
        g = rng.standard_normal(tuple(expected.shape))
        (expected * torch.tensor(g)).sum().backward()
        (out * hg.tensor(g)).sum().backward()
        case = f"F.pad(x of shape {shape}, {amounts}, mode={mode!r})"
        np.testing.assert_array_equal(out.detach().numpy(), expected.detach().numpy(), case)
        if out.numel() == 0:  # PyTorch's reflect gradient is then memory it never wrote
            assert not hx.grad.numpy().any(), case
            continue
        np.testing.assert_allclose(hx.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12,
                                   err_msg=case)
        compared += 1
    assert compared > 100


def test_conv_padding_modes_against_pytorch():
    """Conv1d and Conv2d with every padding_mode (int, pair, 'same' and 'valid' padding,
    strides, dilations, groups, unbatched and empty batches): PyTorch's repr, values and
    gradients of the input, the weight and the bias."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    compared = 0
    for _ in range(80):
        one_d = rng.random() < 0.3
        groups = int(rng.choice([1, 2]))
        cin, cout = groups * int(rng.integers(1, 3)), groups * int(rng.integers(1, 3))
        kernel = tuple(int(rng.integers(1, 4)) for _ in range(1 if one_d else 2))
        stride = tuple(int(rng.integers(1, 3)) for _ in kernel)
        dilation = tuple(int(rng.integers(1, 3)) for _ in kernel)
        mode = str(rng.choice(["zeros", "reflect", "replicate", "circular"]))
        padding = str(rng.choice(["same", "valid", "int", "pair"]))
        if padding == "same":
            stride = (1,) * len(kernel)
        elif padding == "int":
            padding = int(rng.integers(0, 4))
        elif padding == "pair":
            padding = tuple(int(rng.integers(0, 4)) for _ in kernel)
        shape = ((int(rng.integers(0, 3)),) if rng.random() < 0.8 else ()) + (cin,) + tuple(
            int(rng.integers(2, 8)) for _ in kernel)
        name = "Conv1d" if one_d else "Conv2d"
        args = (cin, cout, kernel, stride, padding, dilation, groups, True, mode)
        theirs = getattr(torch.nn, name)(*args).double()
        ours = getattr(nn, name)(*args).double()
        assert repr(ours) == repr(theirs)
        ours.load_state_dict({k: hg.tensor(v.detach().numpy())
                              for k, v in theirs.state_dict().items()})
        x = rng.standard_normal(shape)
        tx, hx = torch.tensor(x, requires_grad=True), hg.tensor(x, requires_grad=True)
        try:
            expected = theirs(tx)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                ours(hx)
            continue
        out = ours(hx)
        g = rng.standard_normal(tuple(expected.shape))
        (expected * torch.tensor(g)).sum().backward()
        (out * hg.tensor(g)).sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-10,
                                   atol=1e-12)
        np.testing.assert_allclose(hx.grad.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-12)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-10, atol=1e-12)
        compared += 1
    assert compared > 50


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_pad_on_the_gpu(mode):
    """The same values and gradients on cupy arrays as on numpy ones."""
    x = np.random.default_rng(6).standard_normal((2, 3, 4, 5)).astype(np.float32)
    results = []
    for device in ("cuda:0", "cpu"):
        t = hg.tensor(x, requires_grad=True)
        out = F.pad(t.to(device), (2, 1, 0, 3), mode=mode)
        (out * out).sum().backward()
        results.append((out.detach().cpu().numpy(), t.grad.numpy()))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)
