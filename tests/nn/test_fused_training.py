"""The fused Nodes of the training step (cross-entropy, convolution product) against the unfused
graph, finite differences and PyTorch."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.nn import _conv, _functions


def _logits(dtype, n=7, c=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, c)).astype(dtype) * 3, rng.integers(0, c, n)


def _loss_and_grad(x, t, **kwargs):
    x = hg.tensor(x, requires_grad=True)
    loss = F.cross_entropy(x, t, **kwargs)
    loss.backward()
    return loss.array, x.grad.array


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_cross_entropy_has_the_bits_of_the_unfused_graph(dtype):
    x, t = _logits(dtype)
    fused = _loss_and_grad(x, t)
    # a weight of ones takes the general path (log_softmax, then the weighted pick)
    general = _loss_and_grad(x, t, weight=hg.ones(5, dtype=dtype))
    assert fused[0].dtype == dtype and fused[0].shape == ()
    np.testing.assert_allclose(fused[0], general[0], rtol=4 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(fused[1], general[1])


def test_fused_cross_entropy_is_one_node_only_for_the_common_case():
    x, t = _logits(np.float64)
    xt = hg.tensor(x, requires_grad=True)
    assert type(F.cross_entropy(xt, t).grad_fn).__name__.startswith("CrossEntropy")
    for kwargs in [{"weight": hg.ones(5)}, {"label_smoothing": 0.1}, {"reduction": "sum"}]:
        assert not type(F.cross_entropy(xt, t, **kwargs).grad_fn).__name__.startswith(
            "CrossEntropy")
    t_ignored = t.copy()
    t_ignored[2] = -100
    assert not type(F.cross_entropy(xt, t_ignored).grad_fn).__name__.startswith("CrossEntropy")


def test_fused_cross_entropy_first_and_second_derivatives():
    x, t = _logits(np.float64, n=4, c=3)
    x = hg.tensor(x, requires_grad=True)
    assert gradcheck(lambda a: F.cross_entropy(a, t), (x,))
    assert gradgradcheck(lambda a: F.cross_entropy(a, t), (x,))


def test_fused_cross_entropy_checks_targets_as_before():
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):
        F.cross_entropy(hg.zeros(2, 5), np.array([0, 5]))


@pytest.mark.parametrize("ignored", [False, True])
def test_cross_entropy_matches_torch(ignored):
    torch = pytest.importorskip("torch")
    x, t = _logits(np.float64, n=9, c=4, seed=3)
    if ignored:
        t[[1, 4]] = -100
    loss, grad = _loss_and_grad(x, t)
    xt = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(xt, torch.from_numpy(t))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_product_derivatives(bias):
    rng = np.random.default_rng(4)
    cols = hg.tensor(rng.standard_normal((2, 6, 5)), requires_grad=True)
    w = hg.tensor(rng.standard_normal((3, 6)), requires_grad=True)
    b = hg.tensor(rng.standard_normal(3), requires_grad=True) if bias else None
    inputs = (cols, w, b) if bias else (cols, w)

    def fn(c, weight, bias=None):
        return _functions.ConvMatMul.apply(c, weight, bias)

    out = fn(*inputs).array
    want = np.einsum("ok,nkl->nol", w.array, cols.array)
    if bias:
        want = want + b.array[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-12)
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


@pytest.mark.parametrize("padding", [0, 1, 2, "same"])
def test_stride1_conv_node_first_and_second_derivatives(padding):
    rng = np.random.default_rng(5)
    x = hg.tensor(rng.standard_normal((2, 2, 5, 4)), requires_grad=True)
    w = hg.tensor(rng.standard_normal((3, 2, 3, 3)), requires_grad=True)
    b = hg.tensor(rng.standard_normal(3), requires_grad=True)
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=padding)
    assert type(fn(x, w, b).grad_fn).__name__ == "ConvolutionBackward0"
    assert gradcheck(fn, (x, w, b))
    assert gradgradcheck(fn, (x, w, b))


def test_stride1_conv_node_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x, w, b = rng.standard_normal((3, 4, 7, 6)), rng.standard_normal((5, 4, 3, 3)), \
        rng.standard_normal(5)
    hx, hw, hb = (hg.tensor(a, requires_grad=True) for a in (x, w, b))
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    out = F.conv2d(hx, hw, hb, padding=1)
    want = torch.nn.functional.conv2d(tx, tw, tb, padding=1)
    np.testing.assert_allclose(out.array, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    v = rng.standard_normal(out.shape)
    (out * hg.tensor(v)).sum().backward()
    (want * torch.from_numpy(v)).sum().backward()
    for h, t in [(hx, tx), (hw, tw), (hb, tb)]:
        np.testing.assert_allclose(h.grad.array, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_stride1_conv_input_gradient_in_chunks_equals_in_one_go(monkeypatch):
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((5, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3))

    def input_grad():
        hx = hg.tensor(x, requires_grad=True)
        F.conv2d(hx, hg.tensor(w), padding=1).sum().backward()
        return hx.grad.array

    whole = input_grad()
    monkeypatch.setattr(_conv, "_CHUNK_ELEMENTS", 300)  # one sample (3*9*36 columns) a chunk
    np.testing.assert_allclose(input_grad(), whole, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("batch, bias", [(2, True), (2, False), (40, True)])
def test_linear_small_batch_orientation_matches_the_product(batch, bias):
    # weight @ x.T for batches up to out_features / 8, x @ weight.T above. The two are different
    # GEMM calls: a BLAS may pick another kernel (blocking, order of the sums, FMA) for each, so
    # their bits may differ by machine. What holds everywhere is the rounding bound of a K-term
    # dot product, |fl(s) - s| <= gamma_K * sum |x_k w_k| (Higham, section 3.1), checked against
    # the product in float64; tests/nn/test_fast_paths_differential.py covers random shapes.
    rng = np.random.default_rng(8)
    x = rng.standard_normal((batch, 24)).astype(np.float32)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    hx = hg.tensor(x, requires_grad=True)
    out = F.linear(hx, hg.tensor(w), hg.tensor(b) if bias else None)
    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)
    want = x64 @ w64.T + (b64 if bias else 0)
    magnitude = np.abs(x64) @ np.abs(w64).T + (np.abs(b64) if bias else 0)
    assert out.array.flags.c_contiguous and out.dtype == np.float32
    terms = 24 + 1
    assert np.all(np.abs(out.array - want) <= 2 * terms * np.finfo(np.float32).eps * magnitude)
    out.sum().backward()  # ones @ weight: a 40-term sum per column, within its bound too
    error = np.abs(hx.grad.array - w64.sum(0))
    assert np.all(error <= 2 * 40 * np.finfo(np.float32).eps * np.abs(w64).sum(0))
