"""Each nn fast path beside its plain formula: the fused cross-entropy, the convolution
Node, Linear's two GEMM orientations, the numba ReLU backward (Note [Where the training step
goes] in hpcgrad/nn/_functions.py says why each exists).

Every case draws its shapes and dtype from its seed, runs forward, backward and (where the fast
path claims it) double backward, and compares with a reference built from simple hpcgrad ops
in float64 (elementwise products and sums: no GEMM, no fused Node), and with PyTorch when
installed.

Tolerances. A product-and-sum result (Linear, conv, and every derivative of them) is checked
against the float64 reference with the rounding-error bound of a K-term sum,
``|fl(s) - s| <= gamma_K * sum |terms|``, gamma_K ~ K * u (Higham, Accuracy and Stability of
Numerical Algorithms, section 3.1), here ``2 * K * eps * magnitude`` with eps = 2u: it holds for
whatever order, blocking or FMA a BLAS kernel picks. The magnitude (``sum |terms|``) is the
same reference evaluated on absolute values, exact for these bilinear maps. The ReLU backward
is a select (no arithmetic), so it must give the reference's bits.
"""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import grad as autograd_grad
from hpcgrad.nn import _conv, _functions

SEEDS = range(12)


def _rng_dtype(seed):
    rng = np.random.default_rng(1000 + seed)
    return rng, (np.float32, np.float64)[seed % 2]


def _t(array, dtype=np.float64, grad=True):
    return hg.tensor(np.asarray(array, dtype=dtype), requires_grad=grad)


def _assert_within_bound(got, want, magnitude, terms, dtype, what):
    """|got - want| <= 2 * K * eps(dtype) * magnitude (+ the smallest normal, for zeros)."""
    got = np.asarray(got, dtype=np.float64)
    tol = 2 * terms * np.finfo(dtype).eps * np.asarray(magnitude) + np.finfo(dtype).tiny
    err = np.abs(got - want)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape}, expected {np.shape(want)}"
    assert np.all(err <= tol), (f"{what}: error {err.max():.3g} above the {terms}-term bound "
                                f"(at most {tol.max():.3g}; dtype {np.dtype(dtype).name})")


def _bilinear_run(fn, arrays, upstream, upstream2, dtype, second_order):
    """fn(*tensors) on arrays of ``dtype``: the output, the gradients of <out, upstream> and,
    if ``second_order``, the gradients of <first gradients, upstream2> (create_graph)."""
    inputs = [_t(a, dtype) for a in arrays]
    out = fn(*inputs)
    u = hg.tensor(upstream.astype(dtype))
    if not second_order:
        (out * u).sum().backward()
        return [out.array] + [x.grad.array for x in inputs]
    firsts = autograd_grad((out * u).sum(), inputs, create_graph=True)
    total = sum((g * hg.tensor(v.astype(dtype))).sum() for g, v in zip(firsts, upstream2))
    seconds = autograd_grad(total, inputs, allow_unused=True)
    zeros = [np.zeros(a.shape, dtype) for a in arrays]  # bias: linear, no second derivative
    return ([out.array] + [g.array for g in firsts]
            + [z if s is None else s.array for s, z in zip(seconds, zeros)])


def _check_bilinear(fast, plain, arrays, terms, dtype, rng, second_order=False):
    """fast vs plain (float64), within the K-term bound, outputs and all derivatives."""
    out_shape = plain(*[_t(a, grad=False) for a in arrays]).shape
    upstream = rng.standard_normal(out_shape)
    upstream2 = [rng.standard_normal(a.shape) for a in arrays]
    cast = [a.astype(dtype).astype(np.float64) for a in arrays]  # what fast computes with
    got = _bilinear_run(fast, cast, upstream, upstream2, dtype, second_order)
    want = _bilinear_run(plain, cast, upstream, upstream2, np.float64, second_order)
    magnitude = _bilinear_run(plain, [np.abs(a) for a in cast], np.abs(upstream),
                              [np.abs(v) for v in upstream2], np.float64, second_order)
    names = ["output"] + [f"grad {i}" for i in range(len(arrays))] \
        + [f"second-order grad {i}" for i in range(len(arrays) if second_order else 0)]
    for g, w, m, name in zip(got, want, magnitude, names):
        assert np.asarray(g).dtype == dtype, f"{name}: dtype {np.asarray(g).dtype}"
        _assert_within_bound(g, w, m, terms, dtype, name)
    return got


# --- Linear: (weight @ x.T).T for batches up to out_features / 8, x @ weight.T above ----------
def _plain_linear(x, w, b=None):
    out = (x.unsqueeze(-2) * w).sum(-1)  # (..., 1, in) * (out, in): no GEMM
    return out if b is None else out + b


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("orientation", ["small_batch", "large_batch", "3d_input"])
def test_linear_orientations_match_the_plain_formula(orientation, seed):
    rng, dtype = _rng_dtype(seed)
    in_f, out_f = int(rng.integers(1, 70)), int(rng.integers(8, 90))
    limit = out_f // 8  # Linear.forward's threshold: 8 * batch <= out_features
    batch = {"small_batch": int(rng.integers(1, limit + 1)),
             "large_batch": int(rng.integers(limit + 1, limit + 40)),
             "3d_input": int(rng.integers(1, 6))}[orientation]
    x_shape = (batch, in_f) if orientation != "3d_input" else (batch, 3, in_f)
    if orientation != "3d_input":  # a 3-D input always takes x @ weight.T
        assert (8 * batch <= out_f) == (orientation == "small_batch")
    arrays = [rng.standard_normal(x_shape), rng.standard_normal((out_f, in_f))]
    if seed % 3:
        arrays.append(rng.standard_normal(out_f))
    rows = int(np.prod(x_shape[:-1]))
    got = _check_bilinear(F.linear, _plain_linear, arrays, max(in_f + 1, out_f, rows), dtype,
                          rng, second_order=seed % 4 == 0)
    assert got[0].flags.c_contiguous  # the small-batch orientation is put back in C order
    torch = pytest.importorskip("torch")
    ts = [torch.tensor(a) for a in arrays]
    np.testing.assert_allclose(F.linear(*[_t(a, grad=False) for a in arrays]).data,
                               torch.nn.functional.linear(*ts).numpy(), rtol=1e-10, atol=1e-10)


# --- the convolution Node (any stride, dilation, groups) --------------------------------------
def _plain_conv(padding, stride=(1, 1), dilation=(1, 1), groups=1):
    """Correlation with (top, bottom, left, right) zero padding from slices, products and sums
    only: out[n, o] = sum_{c in o's group, i, j} x[n, c, s*. + d*i, s*. + d*j] * w[o, c, i, j]."""
    top, bottom, left, right = padding
    (sh, sw), (dh, dw) = stride, dilation

    def conv(x, w, b=None):
        n, c, h, wd = x.shape
        out_ch, cg, kh, kw = w.shape
        if top or bottom or left or right:
            zeros = hg.zeros(n, c, top, wd, dtype=x.dtype), hg.zeros(n, c, bottom, wd,
                                                                     dtype=x.dtype)
            x = hg.cat([zeros[0], x, zeros[1]], 2)
            side = (hg.zeros(n, c, x.shape[2], left, dtype=x.dtype),
                    hg.zeros(n, c, x.shape[2], right, dtype=x.dtype))
            x = hg.cat([side[0], x, side[1]], 3)
        ho = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
        wo = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
        og = out_ch // groups
        out = None
        for i in range(kh):
            for j in range(kw):
                patch = x[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh,
                          j * dw:j * dw + sw * (wo - 1) + 1:sw]  # (N, C, Ho, Wo)
                patch = patch.reshape(n, groups, 1, cg, ho, wo)
                term = (patch * w[:, :, i, j].reshape(1, groups, og, cg, 1, 1)).sum(3)
                term = term.reshape(n, out_ch, ho, wo)
                out = term if out is None else out + term
        return out if b is None else out + b.reshape(1, out_ch, 1, 1)
    return conv


# Settings that send the Node's columns another way than its defaults do on small shapes:
# the input gradient folded at stride 1, the weight gradient's product as (Og, K), columns from
# a padded copy with the old im2col and col2im, and chunks of one sample (sums added chunk by
# chunk). Each is compared with slices and sums as the default route is.
ROUTES = {
    "fold_input_grad": {"_INPUT_GRAD_FOLD": 1, "_DIRECT_DEFAULT": False},
    "weight_grad_rows_first": {"_WEIGHT_GRAD_TRANSPOSED": 0},
    "padded_columns": {"_UNFOLD_PLANES": False, "_DIRECT_DEFAULT": False},
    "one_sample_chunks": {"_CHUNK_ELEMENTS": 1, "_CHUNK_POSITIONS": 1, "_INPUT_GRAD_FOLD": 1,
                          "_WEIGHT_GRAD_TRANSPOSED": 0, "_DIRECT_DEFAULT": False},
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("seed", range(8))
def test_conv2d_node_by_every_route_matches_the_plain_formula(seed, route, monkeypatch):
    for name, value in ROUTES[route].items():
        monkeypatch.setattr(_conv, name, value)
    test_conv2d_node_matches_the_plain_formula(100 + seed)


@pytest.mark.parametrize("seed", range(24))
def test_conv2d_node_matches_the_plain_formula(seed):
    """The one-Node convolution (F.conv2d) against slices and sums, float32 and float64, first
    and (every other seed) second derivatives: stride, dilation, groups, asymmetric padding and
    the empty batch drawn from the seed."""
    rng, dtype = _rng_dtype(seed)
    groups = int(rng.choice([1, 1, 2, 3]))
    n, out_ch = int(rng.integers(0, 4)), groups * int(rng.integers(1, 4))
    c = groups * int(rng.integers(1, 3))
    kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    h = int(rng.integers(dilation[0] * (kh - 1) + 1, dilation[0] * (kh - 1) + 6))
    w = int(rng.integers(dilation[1] * (kw - 1) + 1, dilation[1] * (kw - 1) + 6))
    padding = tuple(int(rng.integers(0, k)) for k in (kh, kh, kw, kw))  # asymmetric too
    arrays = [rng.standard_normal((n, c, h, w)), rng.standard_normal((out_ch, c // groups, kh, kw))]
    if seed % 3:
        arrays.append(rng.standard_normal(out_ch))
    bias = len(arrays) == 3

    def fast(x, weight, b=None):
        out = _conv.Convolution.apply(x, weight, b if bias else None, stride, padding, dilation,
                                      groups)
        assert type(out.grad_fn).__name__ == "ConvolutionBackward0"  # the Node, as PyTorch's
        return out

    ho = (h + padding[0] + padding[1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + padding[2] + padding[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    terms = max((c // groups) * kh * kw + 1, out_ch * kh * kw, max(n, 1) * ho * wo)
    _check_bilinear(fast, _plain_conv(padding, stride, dilation, groups), arrays, terms, dtype,
                    rng, second_order=seed % 2 == 0)


def test_conv2d_node_in_chunks_and_on_a_strided_input_equals_in_one_go(monkeypatch):
    """Columns a sample at a time (a small workspace) and an input that is a transposed view
    agree with one chunk on a contiguous input (float64; the weight gradient's sums are
    grouped by chunk, and a BLAS may block products of other widths otherwise)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 6, 7, 6))
    w = rng.standard_normal((4, 3, 3, 3))

    def run(array):
        hx, hw = hg.tensor(array, requires_grad=True), hg.tensor(w, requires_grad=True)
        out = F.conv2d(hx, hw, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
        (out * out).sum().backward()
        return out.array, hx.grad.array, hw.grad.array

    whole = run(x)
    assert _conv._Geometry(x.shape, w.shape, (2, 1), (1, 1, 1, 1), (1, 2), 2).step == 5
    monkeypatch.setattr(_conv, "_CHUNK_ELEMENTS", 100)  # one sample a chunk ...
    monkeypatch.setattr(_conv, "_CHUNK_POSITIONS", 1)  # ... however few positions it has
    assert _conv._Geometry(x.shape, w.shape, (2, 1), (1, 1, 1, 1), (1, 2), 2).step == 1
    for got, want in zip(run(np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)),
                         whole):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's, for even kernels
@pytest.mark.parametrize("seed", SEEDS)
def test_conv2d_dispatch_matches_torch(seed):
    """F.conv2d beside torch, float64: stride, padding ('same' too), dilation and groups
    (depthwise when the groups are the channels) drawn from the seed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2000 + seed)
    kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    stride = int(rng.integers(1, 3))
    dilation = int(rng.integers(1, 3))
    groups = int(rng.choice([1, 2, 4]))
    padding = "same" if stride == 1 and seed % 4 == 0 else (int(rng.integers(0, kh)),
                                                            int(rng.integers(0, kw)))
    x = rng.standard_normal((int(rng.integers(0, 3)), 4, dilation * kh + 3, dilation * kw + 4))
    out_ch = groups * int(rng.integers(1, 3))
    w, b = rng.standard_normal((out_ch, 4 // groups, kh, kw)), rng.standard_normal(out_ch)
    results = []
    for lib, conv, tensor in ((hg, F.conv2d, _t),
                              (torch, torch.nn.functional.conv2d,
                               lambda a: torch.tensor(a, requires_grad=True))):
        ts = [tensor(a) for a in (x, w, b)]
        out = conv(*ts, stride=stride, padding=padding, dilation=dilation, groups=groups)
        u = np.random.default_rng(seed).standard_normal(tuple(out.shape))
        (out * (hg.tensor(u) if lib is hg else torch.tensor(u))).sum().backward()
        results.append([np.asarray(out.data if lib is hg else out.detach().numpy())]
                       + [np.asarray(t.grad.data if lib is hg else t.grad.numpy()) for t in ts])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


# --- the fused cross-entropy ------------------------------------------------------------------
def _plain_cross_entropy(x, target):
    """mean_i (logsumexp(x_i) - x_i[t_i]) from exp, log, sums and a one-hot mask."""
    n, classes = x.shape
    shift = hg.tensor(x.array.max(1, keepdims=True))  # a constant: the shift's gradient cancels
    z = x - shift
    lse = z.exp().sum(1, keepdim=True).log()
    onehot = hg.tensor((np.arange(classes) == target[:, None]).astype(x.dtype))
    return ((lse - z) * onehot).sum() * (1.0 / n)


@pytest.mark.parametrize("seed", SEEDS)
def test_fused_cross_entropy_matches_the_plain_formula(seed):
    rng, dtype = _rng_dtype(seed)
    n, classes = int(rng.integers(1, 40)), int(rng.integers(1, 30))
    scale = (1.0, 30.0)[seed % 3 == 0]  # large logits: the shift must keep exp finite
    x = (rng.standard_normal((n, classes)) * scale).astype(dtype)
    target = rng.integers(0, classes, n)
    v = rng.standard_normal((n, classes))
    eps = np.finfo(dtype).eps
    results = []
    for fn, dt in ((F.cross_entropy, dtype), (_plain_cross_entropy, np.float64)):
        xt = _t(x, dt)
        loss = fn(xt, target)
        (g,) = autograd_grad(loss, [xt], create_graph=True)
        (gg,) = autograd_grad((g * hg.tensor(v.astype(dt))).sum(), [xt])
        results.append((loss.array, g.array, gg.array, loss.grad_fn))
    (loss, g, gg, node), (want_loss, want_g, want_gg, _) = results
    assert isinstance(node, _functions.CrossEntropy._backward_cls)  # the fused Node
    assert loss.dtype == g.dtype == dtype
    # a log of a sum of C positive terms plus an N-term mean: a few ulps of their size each
    lse_size = np.abs(x).max() + np.log(classes) + 1
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=4 * (classes + n) * eps * lse_size)
    # softmax - onehot is in [-1, 1], divided by N; its error is a few ulps of the exp sum
    np.testing.assert_allclose(g, want_g, rtol=0, atol=4 * (classes + 4) * eps / n)
    np.testing.assert_allclose(gg, want_gg, rtol=0,
                               atol=4 * (classes + 4) * eps * np.abs(v).max() * 2 / n)
    # the plain backward (arrays, not the create_graph formula above), and the unfused graph
    # (log_softmax + nll_loss) whose bits it keeps (CrossEntropy.backward says why)
    xt = _t(x, dtype)
    F.cross_entropy(xt, target).backward()
    np.testing.assert_allclose(xt.grad.array, want_g, rtol=0, atol=4 * (classes + 4) * eps / n)
    unfused = _t(x, dtype)
    F.nll_loss(F.log_softmax(unfused, 1), target).backward()
    np.testing.assert_array_equal(xt.grad.array, unfused.grad.array)
    torch = pytest.importorskip("torch")
    xtorch = torch.tensor(x.astype(np.float64), requires_grad=True)
    tl = torch.nn.functional.cross_entropy(xtorch, torch.tensor(target))
    tl.backward()
    np.testing.assert_allclose(want_loss, tl.item(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(want_g, xtorch.grad.numpy(), rtol=1e-10, atol=1e-14)


# --- the numba ReLU backward ------------------------------------------------------------------
def _special_values(rng, shape, dtype):
    a = np.asarray(rng.standard_normal(shape), dtype=dtype)  # 0-d: an array, not a scalar
    flat = a.reshape(-1)
    if flat.size:
        picks = rng.integers(0, flat.size, 4)
        flat[picks[:2]] = 0.0  # relu'(0) = 0, as PyTorch's threshold_backward
        flat[picks[2]] = np.nan
        flat[picks[3]] = -np.inf
    return a


@pytest.mark.parametrize("seed", SEEDS)
def test_relu_backward_matches_the_select(seed):
    rng, dtype = _rng_dtype(seed)
    shape = tuple(int(s) for s in rng.integers(0 if seed == 3 else 1, 7, int(rng.integers(0, 4))))
    x = _special_values(rng, shape, dtype)
    g = _special_values(rng, shape, dtype)  # inf and NaN where relu is flat still give 0
    xt = hg.tensor(x.copy(), requires_grad=True)
    xt.relu().backward(hg.tensor(g))
    y = np.maximum(x, 0)
    want = np.where(y <= 0, dtype(0), g)  # PyTorch's threshold_backward(g, relu(x), 0)
    assert xt.grad.dtype == dtype
    np.testing.assert_array_equal(xt.grad.array, want)  # a select: the same bits
    # the kernel itself, and the np.where path a non-contiguous gradient takes
    from hpcgrad.base.kernels.cpu import threshold_backward
    np.testing.assert_array_equal(threshold_backward(g, y), want)
    if x.ndim >= 2 and x.size:  # F-ordered: relu's backward takes np.where, same bits
        xt2 = hg.tensor(np.asfortranarray(x.T), requires_grad=True)
        xt2.relu().backward(hg.tensor(np.asfortranarray(g.T)))
        np.testing.assert_array_equal(xt2.grad.array, want.T)
    torch = pytest.importorskip("torch")
    xtorch = torch.tensor(x, requires_grad=True)
    torch.relu(xtorch).backward(torch.tensor(g))
    np.testing.assert_array_equal(xt.grad.data, xtorch.grad.numpy())
