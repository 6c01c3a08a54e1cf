"""The convolution Node through Winograd's tiles (Note [Winograd convolution]) against the plain
sum of products, its own formulas' rounding bound, PyTorch and gradcheck: values and both
gradients on drawn shapes, uneven padding, odd outputs, the empty batch, chunks of samples and
a non-contiguous input."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.base.kernels import winograd
from hpcgrad.nn import _conv

_spec = importlib.util.spec_from_file_location(
    "winograd_reference", Path(__file__).parents[1] / "base" / "kernels" / "winograd_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


@pytest.fixture
def every_conv(monkeypatch):
    """Winograd's tiles for every 3x3 stride-1 convolution, however few its channels and
    tiles; counts the chunks that took them."""
    monkeypatch.setattr(_conv, "_WINOGRAD_CHANNELS", 1)
    monkeypatch.setattr(_conv, "_WINOGRAD_TILES", 1)
    monkeypatch.delenv("HPCGRAD_WINOGRAD", raising=False)
    calls = []
    kernel = winograd.output_tiles
    monkeypatch.setattr(winograd, "output_tiles", lambda *a: calls.append(1) or kernel(*a))
    return calls


def _plain(x, w, up, padding):
    """out[n, o] = sum over c, i, j of x_padded[n, c, . + i, . + j] w[o, c, i, j], and the
    gradients of <out, up>, from windows and einsum in float64 (no transforms)."""
    top, bottom, left, right = padding
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    win = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    out = np.einsum("ncyzij,ocij->noyz", win, w)
    grad_w = np.einsum("ncyzij,noyz->ocij", win, up)
    grad_padded = np.zeros_like(x)
    ho, wo = up.shape[2:]
    for i in range(3):
        for j in range(3):
            grad_padded[:, :, i:i + ho, j:j + wo] += np.einsum("noyz,oc->ncyz", up, w[:, :, i, j])
    grad_x = grad_padded[:, :, top:x.shape[2] - bottom, left:x.shape[3] - right]
    return out, grad_x, grad_w


@pytest.mark.parametrize("seed", range(16))
def test_winograd_node_matches_the_plain_sums_within_its_rounding_bound(seed, every_conv):
    """Values and both gradients against the plain sums, within 2 K eps times the magnitude of
    the sums Winograd's algorithm forms (its formulas on absolute values: tiles' transforms can
    exceed the plain terms, and a plain zero, an output over padding only, comes out as a
    rounding-sized value here)."""
    rng = np.random.default_rng(3000 + seed)
    dtype = (np.float32, np.float64)[seed % 2]
    n, c, o = int(rng.integers(0, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
    padding = tuple(int(rng.integers(0, 3)) for _ in range(4))
    h = int(rng.integers(max(1, 3 - padding[0] - padding[1]), 10))
    w = int(rng.integers(max(1, 3 - padding[2] - padding[3]), 10))
    x = rng.standard_normal((n, c, h, w)).astype(dtype).astype(np.float64)
    weight = rng.standard_normal((o, c, 3, 3)).astype(dtype).astype(np.float64)
    hx, hw = hg.tensor(x.astype(dtype), requires_grad=True), \
        hg.tensor(weight.astype(dtype), requires_grad=True)
    out = _conv.Convolution.apply(hx, hw, None, (1, 1), padding, (1, 1), 1)
    up = rng.standard_normal(out.shape)
    (out * hg.tensor(up.astype(dtype))).sum().backward()
    assert bool(every_conv) == (n > 0)  # the empty batch keeps the columns' path
    got = (out.array, hx.grad.array, hw.grad.array)
    want = _plain(x, weight, up, padding)
    if n:
        magnitude = ref.conv(x, weight, up, padding, absolute=True)
        np.testing.assert_allclose(ref.conv(x, weight, up, padding)[0], want[0], rtol=1e-12,
                                   atol=1e-12)  # the reference's formulas are the convolution
    else:
        magnitude = [np.zeros_like(a) for a in want]
    terms = max(c * 9, o * 9, max(n, 1) * out.shape[2] * out.shape[3]) + 32
    for g, wv, m, name in zip(got, want, magnitude, ("output", "grad x", "grad w")):
        assert g.dtype == dtype and g.shape == wv.shape, name
        bound = 2 * terms * np.finfo(dtype).eps * m + np.finfo(dtype).tiny
        err = np.abs(g.astype(np.float64) - wv)
        assert np.all(err <= bound), f"{name}: error {err.max():.3g} above the bound"


@pytest.mark.torch_reference
@pytest.mark.parametrize("padding", [1, 0, (2, 1)])
def test_winograd_conv2d_matches_torch_and_gradcheck(padding, every_conv):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x, w, b = (rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3)),
               rng.standard_normal(4))
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    hs = [hg.tensor(a, requires_grad=True) for a in (x, w, b)]
    want = torch.nn.functional.conv2d(*ts, padding=padding)
    got = F.conv2d(*hs, padding=padding)
    u = rng.standard_normal(tuple(want.shape))
    (want * torch.tensor(u)).sum().backward()
    (got * hg.tensor(u)).sum().backward()
    assert every_conv
    for g, t in zip([got] + [h.grad for h in hs], [want] + [t.grad for t in ts]):
        np.testing.assert_allclose(np.asarray(g.data), t.detach().numpy(), rtol=1e-10,
                                   atol=1e-10)
    small = [hg.tensor(rng.standard_normal(s), requires_grad=True)
             for s in ((1, 2, 4, 5), (2, 2, 3, 3))]
    assert hg.autograd.gradcheck(lambda a, k: F.conv2d(a, k, padding=padding), small)


def test_winograd_in_chunks_and_on_a_strided_input_equals_in_one_go(monkeypatch, every_conv):
    """A sample a chunk (the weight's gradient summed chunk by chunk) and an input that is a
    transposed view agree with one chunk on a contiguous input (float64)."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((5, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3))

    def run(array):
        hx, hw = hg.tensor(array, requires_grad=True), hg.tensor(w, requires_grad=True)
        out = F.conv2d(hx, hw, padding=1)
        (out * out).sum().backward()
        return out.array, hx.grad.array, hw.grad.array

    whole = run(x)
    calls = len(every_conv)
    monkeypatch.setattr(_conv, "_WINOGRAD_ELEMENTS", 1)
    chunked = run(np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2))
    assert len(every_conv) - calls == 5 + 0  # forward: one chunk a sample (backward: no output)
    for got, want in zip(chunked, whole):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_winograd_takes_wide_3x3_convolutions_of_enough_tiles_and_the_setting_turns_it_off(
        monkeypatch):
    x, w = np.zeros((32, 128, 4, 4), np.float32), np.zeros((128, 128, 3, 3), np.float32)
    geo = _conv._Geometry(x.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    monkeypatch.delenv("HPCGRAD_WINOGRAD", raising=False)
    assert _conv._winograd(x, w, geo)  # 32 samples x 4 tiles
    fewer = _conv._Geometry((16, 128, 4, 4), w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert not _conv._winograd(x[:16], w, fewer)
    narrow = _conv._Geometry((32, 32, 4, 4), (128, 32, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    assert not _conv._winograd(x[:, :32], w[:, :32], narrow)
    assert _conv._winograd(x[:, :48], w[:, :48], _conv._Geometry(
        (32, 48, 4, 4), (128, 48, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1))
    strided = _conv._Geometry(x.shape, w.shape, (2, 2), (1, 1, 1, 1), (1, 1), 1)
    assert not _conv._winograd(x, w, strided)
    monkeypatch.setenv("HPCGRAD_WINOGRAD", "0")
    assert not _conv._winograd(x, w, geo)


@pytest.mark.parametrize("padding", [(1, 1), (0, 0), (2, 1), (0, 2)])
def test_winograd_writes_every_element_it_reads_of_a_reused_workspace(padding, monkeypatch,
                                                                      every_conv):
    """The workspaces come back from earlier layers holding anything: here every one is NaN
    when handed out, so an element the transforms read that no copy or zeroing wrote (the
    input planes' padding, channels past the real ones, a cut last tile) would show as NaN.
    Values equal those of fresh workspaces."""
    real = _conv._workspace

    def stale(like, size, slot=0):
        space = real(like, size, slot)
        space.fill(np.nan)
        return space
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((3, 5, 7, 6)), rng.standard_normal((6, 5, 3, 3))

    def run():
        hx, hw = hg.tensor(x, requires_grad=True), hg.tensor(w, requires_grad=True)
        out = F.conv2d(hx, hw, padding=padding)
        (out * out).sum().backward()
        return out.array, hx.grad.array, hw.grad.array
    want = run()
    monkeypatch.setattr(_conv, "_workspace", stale)
    calls = len(every_conv)
    got = run()
    assert len(every_conv) > calls
    for g, v in zip(got, want):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, v, rtol=1e-12, atol=1e-12)
