"""The direct convolution (kernels/direct_conv.py) beside slices and sums, the columns and PyTorch.

Note [Direct convolution] says why the kernels (forward, strided, weight gradient) exist.
``_check_kernel`` holds the kernel to a float64 slice-and-sum formula in numpy with the K-term
rounding bound of tests/nn/test_fast_paths_differential.py (``2 * K * eps * sum |terms|``: any
order of the sums, FMA or not) and to the columns' path (``_conv._columns_forward``) with twice
that; the strided and weight-gradient kernels to their own slice-and-sum formulas; the Node's
tests run forward and backward (the input gradient at stride 1 is a forward convolution too,
Note [Input gradient as a convolution]) with the direct kernel forced on at every row length
and off (HPCGRAD_DIRECT_CONV=0), and gradcheck in float64.
"""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck
from hpcgrad.base.kernels import direct_conv
from hpcgrad.nn import _conv


def _slices_and_sums(padded, w, dilation, stride=(1, 1)):
    """out[n, k, y, x] = sum_{c, i, j} padded[n, c, sh*y + dh*i, sw*x + dw*j] * w[k, c, i, j], in
    float64 from slices: the value and the same sum of absolute terms (the error bound's scale)."""
    n, c, hp, wp = padded.shape
    k, _, kh, kw = w.shape
    dh, dw = dilation
    sh, sw = stride
    ho, wo = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    x, w = padded.astype(np.float64), w.astype(np.float64)
    out, magnitude = np.zeros((n, k, ho, wo)), np.zeros((n, k, ho, wo))
    for i in range(kh):
        for j in range(kw):
            rows = slice(dh * i, dh * i + sh * (ho - 1) + 1, sh)
            patch = x[:, :, rows, dw * j:dw * j + sw * (wo - 1) + 1:sw]
            out += np.einsum("nchw,kc->nkhw", patch, w[:, :, i, j])
            magnitude += np.einsum("nchw,kc->nkhw", np.abs(patch), np.abs(w[:, :, i, j]))
    return out, magnitude


def _assert_within(got, want, magnitude, terms, dtype, what):
    tol = 2 * terms * np.finfo(dtype).eps * magnitude + np.finfo(dtype).tiny
    err = np.abs(np.asarray(got, np.float64) - want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert np.all(err <= tol), (f"{what}: error {err.max():.3g} above the {terms}-term bound "
                                f"(at most {tol.max():.3g}; {np.dtype(dtype).name})")


def _check_kernel(dtype, n, c, k, size, kernel, padding, dilation=(1, 1), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + size).astype(dtype)
    w = rng.standard_normal((k, c) + kernel).astype(dtype)
    padded = np.ascontiguousarray(_conv._padded(x, padding))
    got = direct_conv.conv2d_stride1(padded, w, dilation)
    want, magnitude = _slices_and_sums(padded, w, dilation)
    terms = c * kernel[0] * kernel[1]
    _assert_within(got, want, magnitude, terms, dtype, "direct vs slices and sums")
    geo = _conv._Geometry(x.shape, w.shape, (1, 1), padding, dilation, 1)
    columns = _conv._columns_forward(x, w, geo).reshape(got.shape)
    _assert_within(got, columns.astype(np.float64), magnitude, 2 * terms, dtype,
                   "direct vs columns")


CASES = [  # (n, c, k, (h, w), (kh, kw), padding (top, bottom, left, right), dilation)
    (32, 16, 16, (32, 32), (3, 3), (1, 1, 1, 1), (1, 1)),  # ResNet-18 width 16
    (4, 32, 32, (16, 16), (3, 3), (1, 1, 1, 1), (1, 1)),
    (2, 3, 16, (32, 32), (3, 3), (1, 1, 1, 1), (1, 1)),  # its stem
    (2, 5, 7, (9, 19), (1, 1), (0, 0, 0, 0), (1, 1)),  # odd sizes, 1x1, outputs % 4 != 0
    (3, 6, 5, (11, 21), (5, 5), (2, 2, 2, 2), (1, 1)),  # 5x5
    (2, 4, 9, (12, 33), (3, 2), (1, 0, 2, 1), (2, 3)),  # asymmetric padding, dilation
    (1, 1, 1, (1, 1), (3, 3), (1, 1, 1, 1), (1, 1)),  # one pixel, one channel
    (2, 3, 2, (5, 40), (3, 3), (0, 0, 0, 0), (1, 1)),  # no padding: rows of 38
    (0, 4, 4, (8, 16), (3, 3), (1, 1, 1, 1), (1, 1)),  # empty batch
    (2, 40, 6, (8, 8), (3, 3), (1, 1, 1, 1), (1, 1)),  # chunks of channels; float32 row pairs
    (3, 20, 5, (7, 4), (3, 3), (1, 1, 1, 1), (1, 1)),  # float64 row pairs, an odd row left
    (2, 9, 11, (12, 8), (3, 3), (1, 1, 1, 1), (1, 1)),  # 512 bits: four rows of 8 a block
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_slices_and_sums_and_the_columns(dtype, case):
    _check_kernel(dtype, *case)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_every_vector_width_and_block_gives_the_same_sums(dtype, case):
    """The kernels for 256- and 512-bit vectors and blocks of 4 and 8 outputs sum each output's
    terms in one order: equal bit for bit, whichever this CPU runs (a 512-bit vector runs as
    two 256-bit halves on a CPU without AVX-512, slower, not different). Blocks of 8 meet
    outputs % 8 != 0 here (5, 7, 9, 6 outputs), 512 bits rows of one vector (16 float32 or 8
    float64 positions) and the scalar loop past the blocks (rows of 7, 19, 21, 33 ...)."""
    n, c, k, size, kernel, padding, dilation = case
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c) + size).astype(dtype)
    w = rng.standard_normal((k, c) + kernel).astype(dtype)
    padded = np.ascontiguousarray(_conv._padded(x, padding))
    outs = {key: direct_conv.conv2d_stride1(padded, w, dilation, bits=key[0], per=key[1])
            for key in direct_conv.KERNELS}
    first = outs[(256, 4)]
    for key, got in outs.items():
        assert np.array_equal(got, first), (f"{key[0]}-bit vectors with blocks of {key[1]}: "
                                            f"differs from 256 x 4 by {np.abs(got - first).max()}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_padding_as_the_kernels_go_gives_the_padded_copys_sums(dtype, case):
    """Note [Padding as the kernels go]: the forward at every vector width and block, and the
    weight gradient at both widths, over the unpadded input (``padding=``) equal the same
    kernels over its padded copy bit for bit: chunks of 16 channels and a shorter last one (40
    channels), passes of several samples and a shorter last one (planes of 16x16 and 12x8),
    asymmetric padding, none, and the empty batch. The input is left as it was."""
    n, c, k, size, kernel, padding, dilation = case
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c) + size).astype(dtype)
    w = rng.standard_normal((k, c) + kernel).astype(dtype)
    before = x.copy()
    padded = np.ascontiguousarray(_conv._padded(x, padding))
    for bits, per in direct_conv.KERNELS:
        want = direct_conv.conv2d_stride1(padded, w, dilation, bits=bits, per=per)
        got = direct_conv.conv2d_stride1(x, w, dilation, bits=bits, per=per, padding=padding)
        assert np.array_equal(got, want), f"forward, {bits} bits x {per}"
    g = rng.standard_normal(want.shape).astype(dtype)
    for bits in (256, 512):
        want = direct_conv.weight_grad_stride1(padded, g, kernel, dilation, bits=bits)
        got = direct_conv.weight_grad_stride1(x, g, kernel, dilation, bits=bits, padding=padding)
        assert np.array_equal(got, want), f"weight gradient, {bits} bits"
    assert np.array_equal(x, before)


@pytest.mark.parametrize("size", [16, 32, 48])
def test_the_default_kernel_takes_this_cpus_widest_vectors(size):
    """On an AVX-512 CPU, rows of 16 or 32k float32 positions take 512-bit vectors and 8 outputs
    a block (the forward of ResNet-18's 16- and 32-channel layers); elsewhere 256 bits and 4."""
    want_bits = 512 if 512 in direct_conv.WIDTHS and (size % 32 == 0 or size == 16) else 256
    assert direct_conv.width_for(size, np.float32) == want_bits
    assert direct_conv.OUTPUTS == (8 if 512 in direct_conv.WIDTHS else 4)
    # 8x8 planes: half a 512-bit vector a row, four rows a block; not where rows are left over
    assert direct_conv.width_for(8, np.float32, ho=8) == (512 if 512 in direct_conv.WIDTHS else 256)
    assert direct_conv.width_for(8, np.float32, ho=6) == 256


def _weight_grad_slices_and_sums(padded, g, kernel, dilation):
    """dw[k, c, i, j] = sum_{n, y, x} g[n, k, y, x] * padded[n, c, y + dh*i, x + dw*j] in
    float64, and the same sum of absolute terms."""
    kh, kw = kernel
    dh, dw = dilation
    _, _, ho, wo = g.shape
    x, g = padded.astype(np.float64), g.astype(np.float64)
    out = np.zeros((g.shape[1], x.shape[1], kh, kw))
    magnitude = np.zeros_like(out)
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, dh * i:dh * i + ho, dw * j:dw * j + wo]
            out[:, :, i, j] = np.einsum("nkhw,nchw->kc", g, patch)
            magnitude[:, :, i, j] = np.einsum("nkhw,nchw->kc", np.abs(g), np.abs(patch))
    return out, magnitude


@pytest.mark.parametrize("bits", [256, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_weight_gradient_matches_slices_and_sums(bits, dtype, case):
    """The weight gradient's kernel at both vector widths (whole vectors, rows past them one
    position at a time, outputs and taps past a block's 4 x 6 or 4 x 2), within the bound of
    its N*Ho*Wo terms."""
    n, c, k, size, kernel, padding, dilation = case
    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, c) + size).astype(dtype)
    padded = np.ascontiguousarray(_conv._padded(x, padding))
    ho = padded.shape[2] - dilation[0] * (kernel[0] - 1)
    wo = padded.shape[3] - dilation[1] * (kernel[1] - 1)
    g = rng.standard_normal((n, k, ho, wo)).astype(dtype)
    got = direct_conv.weight_grad_stride1(padded, g, kernel, dilation, bits=bits)
    want, magnitude = _weight_grad_slices_and_sums(padded, g, kernel, dilation)
    _assert_within(got, want, magnitude, n * ho * wo, dtype, f"weight gradient, {bits} bits")


def test_weight_gradient_refuses_a_gradient_of_another_shape_and_an_unknown_width():
    x = np.zeros((2, 3, 6, 6), np.float32)
    with pytest.raises(ValueError, match=r"not the output of a 3x3 kernel"):
        direct_conv.weight_grad_stride1(x, np.zeros((2, 4, 5, 4), np.float32), (3, 3))
    with pytest.raises(ValueError, match=r"bits must be 256 or 512, not 128"):
        direct_conv.weight_grad_stride1(x, np.zeros((2, 4, 4, 4), np.float32), (3, 3), bits=128)


def test_kernel_refuses_a_width_it_has_no_kernel_for():
    x = np.zeros((1, 2, 5, 18), np.float32)
    with pytest.raises(ValueError, match=r"no kernel for 128-bit vectors and 4 outputs"):
        direct_conv.conv2d_stride1(x, np.zeros((2, 2, 3, 3), np.float32), bits=128, per=4)
    with pytest.raises(ValueError, match=r"no kernel for 512-bit vectors and 4 outputs"):
        direct_conv.conv2d_stride1(x, np.zeros((2, 2, 3, 3), np.float32), bits=512, per=4)


def _strided_case_input(case, seed, dtype):
    """(a generator seeded ``seed``, a random input of the case's shape); skips the case where
    its padded input is shorter than the dilated kernel."""
    n, c, _, size, kernel, (top, bottom, _, _), dilation = case
    if size[0] + top + bottom < dilation[0] * (kernel[0] - 1) + 1:
        pytest.skip("the padded input is smaller than the kernel")
    rng = np.random.default_rng(seed)
    return rng, rng.standard_normal((n, c) + size).astype(dtype)


@pytest.mark.parametrize("stride", [(2, 2), (3, 2), (1, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_strided_kernel_matches_slices_and_sums(stride, dtype, case):
    """conv2d_strided: the stride-1 kernel over the padded input's phases (its own padding:
    rows and columns of padding before a phase's first input row, odd sizes, empty batches)."""
    n, c, k, size, kernel, padding, dilation = case
    rng, x = _strided_case_input(case, 5, dtype)
    w = rng.standard_normal((k, c) + kernel).astype(dtype)
    got = direct_conv.conv2d_strided(x, w, stride, padding, dilation)
    want, magnitude = _slices_and_sums(_conv._padded(x, padding), w, dilation, stride)
    _assert_within(got, want, magnitude, c * kernel[0] * kernel[1], dtype,
                   f"strided {stride} vs slices and sums")


@pytest.mark.parametrize("stride", [(2, 2), (3, 2), (1, 3)])
@pytest.mark.parametrize("bits", [256, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_strided_weight_gradient_matches_slices_and_sums(stride, bits, dtype, case):
    """weight_grad_strided: the weight gradient's kernel over the input's phases, at both
    vector widths, against each weight's products summed over a strided view."""
    n, c, k, size, kernel, padding, dilation = case
    rng, x = _strided_case_input(case, 6, dtype)
    padded = _conv._padded(x, padding)
    (sh, sw), (dh, dw), (kh, kw) = stride, dilation, kernel
    ho = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    g = rng.standard_normal((n, k, ho, wo)).astype(dtype)
    got = direct_conv.weight_grad_strided(x, g, kernel, stride, padding, dilation, bits=bits)
    want = np.zeros((k, c, kh, kw))
    magnitude = np.zeros_like(want)
    for i in range(kh):
        for j in range(kw):
            patch = padded[:, :, dh * i:dh * i + sh * (ho - 1) + 1:sh,
                           dw * j:dw * j + sw * (wo - 1) + 1:sw].astype(np.float64)
            want[:, :, i, j] = np.einsum("nkhw,nchw->kc", g.astype(np.float64), patch)
            magnitude[:, :, i, j] = np.einsum("nkhw,nchw->kc", np.abs(g), np.abs(patch))
    _assert_within(got, want, magnitude, n * ho * wo, dtype, f"strided weight gradient {stride}")


@pytest.mark.parametrize("stride", [(2, 2), (3, 2), (1, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_strided_phases_as_the_kernels_go_give_the_whole_phases_sums(stride, dtype, case):
    """Note [Padding as the kernels go] at a stride: the forward at every vector width and
    block, and the weight gradient at both widths, splitting a chunk's (a pass's) phases as
    they go equal the same kernels over the whole input's phases (``whole=True``) bit for bit."""
    n, c, k, size, kernel, padding, dilation = case
    rng, x = _strided_case_input(case, 7, dtype)
    w = rng.standard_normal((k, c) + kernel).astype(dtype)
    before = x.copy()
    for bits, per in direct_conv.KERNELS:
        want = direct_conv.conv2d_strided(x, w, stride, padding, dilation, bits=bits, per=per,
                                          whole=True)
        got = direct_conv.conv2d_strided(x, w, stride, padding, dilation, bits=bits, per=per)
        assert np.array_equal(got, want), f"forward, {bits} bits x {per}"
    g = rng.standard_normal(want.shape).astype(dtype)
    for bits in (256, 512):
        want = direct_conv.weight_grad_strided(x, g, kernel, stride, padding, dilation,
                                               bits=bits, whole=True)
        got = direct_conv.weight_grad_strided(x, g, kernel, stride, padding, dilation, bits=bits)
        assert np.array_equal(got, want), f"weight gradient, {bits} bits"
    assert np.array_equal(x, before)


def test_strided_weight_gradient_refuses_a_gradient_of_another_shape():
    x = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight_grad_strided: a gradient \[2, 4, 8, 8\] is "
                       r"not the output of a 3x3 kernel at stride \(2, 2\)"):
        direct_conv.weight_grad_strided(x, np.zeros((2, 4, 8, 8), np.float32), (3, 3), (2, 2),
                                        (1, 1, 1, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, stride, padding", [
    ((32, 16, 32, 32), (2, 2), (1, 1, 1, 1)),  # ResNet-18's: whole vectors of each row's run
    ((2, 3, 7, 9), (2, 2), (1, 1, 1, 1)), ((2, 3, 7, 9), (3, 2), (2, 0, 1, 3)),
    ((1, 2, 40, 41), (2, 3), (0, 0, 0, 0)), ((2, 2, 5, 37), (1, 2), (0, 1, 2, 0)),
    ((1, 1, 1, 1), (2, 2), (1, 1, 1, 1)), ((0, 3, 4, 4), (2, 2), (1, 1, 1, 1))])
def test_the_phases_are_the_padded_inputs_strided_views(dtype, shape, stride, padding):
    """_split_phases writes every element (the array starts as NaN): phase (p, q) is the
    padded input's rows p::sh and columns q::sw, zeros past it."""
    x = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    (sh, sw), (top, bottom, left, right) = stride, padding
    n, c, h, w = shape
    hq, wq = -(-(h + top + bottom) // sh), -(-(w + left + right) // sw)
    padded = np.zeros((n, c, hq * sh, wq * sw), dtype)
    padded[:, :, top:top + h, left:left + w] = x
    phases = np.full((n, c, sh, sw, hq, wq), np.nan, dtype)
    direct_conv._split_phases(x, phases, top, left)
    for p in range(sh):
        for q in range(sw):
            np.testing.assert_array_equal(phases[:, :, p, q], padded[:, :, p::sh, q::sw])


def test_kernel_refuses_groups_and_a_kernel_larger_than_the_input():
    x = np.zeros((1, 4, 5, 5), np.float32)
    with pytest.raises(ValueError, match="input channels"):
        direct_conv.conv2d_stride1(x, np.zeros((2, 2, 3, 3), np.float32))
    with pytest.raises(ValueError, match="conv2d_strided: weight .* input channels"):
        direct_conv.conv2d_strided(x, np.zeros((2, 2, 3, 3), np.float32), (2, 2), (0, 0, 0, 0))
    with pytest.raises(ValueError, match="conv2d_strided: the padded input 5x5 is smaller"):
        direct_conv.conv2d_strided(x, np.zeros((2, 4, 3, 3), np.float32), (2, 2), (0, 0, 0, 0),
                                   (3, 1))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        direct_conv.conv2d_stride1(x, np.zeros((2, 4, 3, 3), np.float32), (3, 1))


@pytest.fixture
def direct_everywhere(monkeypatch):
    """The Node takes the direct kernel at any row length and channel count (stride 1, groups
    1, numpy float32/float64), whatever its measured domain."""
    monkeypatch.setenv("HPCGRAD_DIRECT_CONV", "1")
    monkeypatch.setattr(_conv, "_DIRECT_WHOLE_ROWS", False)
    monkeypatch.setattr(_conv, "_DIRECT_MAX_CHANNELS", 1 << 30)
    monkeypatch.setattr(_conv, "_DIRECT_MAX_CHANNELS_SMALL", 1 << 30)
    monkeypatch.setattr(_conv, "_DIRECT_WEIGHT_GRAD_CHANNELS", {256: 1 << 30, 512: 1 << 30})


def _spy(monkeypatch, weight_grads=None):
    """A list that records each convolution the direct kernel runs, strided ones with their
    stride (and, into ``weight_grads``, each weight gradient)."""
    seen, real, real_weight = [], direct_conv.conv2d_stride1, direct_conv.weight_grad_stride1

    def spy(x, w, dilation=(1, 1), out=None, padding=None):
        seen.append((x.shape, w.shape))
        return real(x, w, dilation, out, padding=padding)

    def spy_weight(x, g, kernel_size, dilation=(1, 1), padding=None):
        if weight_grads is not None:
            weight_grads.append((x.shape, g.shape))
        return real_weight(x, g, kernel_size, dilation, padding=padding)

    real_strided = direct_conv.conv2d_strided
    real_weight_strided = direct_conv.weight_grad_strided

    def spy_strided(x, w, stride, padding, dilation=(1, 1), whole=False):
        seen.append((x.shape, w.shape, stride))
        return real_strided(x, w, stride, padding, dilation, whole=whole)

    def spy_weight_strided(x, g, kernel_size, stride, padding, dilation=(1, 1), whole=False):
        if weight_grads is not None:
            weight_grads.append((x.shape, g.shape, stride))
        return real_weight_strided(x, g, kernel_size, stride, padding, dilation, whole=whole)
    monkeypatch.setattr(direct_conv, "conv2d_stride1", spy)
    monkeypatch.setattr(direct_conv, "conv2d_strided", spy_strided)
    monkeypatch.setattr(direct_conv, "weight_grad_stride1", spy_weight)
    monkeypatch.setattr(direct_conv, "weight_grad_strided", spy_weight_strided)
    return seen


def test_the_node_takes_the_kernel_where_measured_faster(monkeypatch):
    """ResNet-18's 16- and 64-channel 3x3 layers (float32 rows of 32, and of 8: two rows a
    block) take it, forward and input gradient, and the 16-channel one its weight gradient;
    a stride-2 layer its forward, and at 512 bits its weight gradient; 64 input channels of
    16x16 only on an AVX-512 CPU, and of 32x32 with the weight gradient; 256 of 16x16, 64 at
    stride 2, 128 of 8x8, rows of 12 float32 and HPCGRAD_DIRECT_CONV=0 do not.
    Winograd's tiles, which come first where they take a convolution, are off here."""
    monkeypatch.delenv("HPCGRAD_DIRECT_CONV", raising=False)
    monkeypatch.setenv("HPCGRAD_WINOGRAD", "0")
    weight_grads = []
    seen = _spy(monkeypatch, weight_grads)
    rng = np.random.default_rng(0)

    def run(c, side, stride=1):
        x = hg.tensor(rng.standard_normal((2, c, side, side)).astype(np.float32),
                      requires_grad=True)
        w = hg.tensor(rng.standard_normal((c, c, 3, 3)).astype(np.float32), requires_grad=True)
        F.conv2d(x, w, stride=stride, padding=1).sum().backward()

    run(16, 32)
    run(64, 8)
    assert len(seen) == 4  # the forwards and the input gradients
    assert [g for _, g in weight_grads] == [(2, 16, 32, 32)]
    seen.clear()
    weight_grads.clear()
    run(16, 32, stride=2)  # its forward through the phases, and at 512 bits its weight's
    assert seen == [((2, 16, 32, 32), (16, 16, 3, 3), (2, 2))]  # gradient; its input's: columns
    wide = 512 in direct_conv.WIDTHS
    assert weight_grads == ([((2, 16, 32, 32), (2, 16, 16, 16), (2, 2))] if wide else [])
    weight_grads.clear()
    seen.clear()
    run(64, 16)  # with 512-bit vectors, up to 128 channels on planes of more than 64 positions
    assert len(seen) == (2 if 512 in direct_conv.WIDTHS else 0) and weight_grads == []
    seen.clear()
    run(64, 32)  # ... and the weight gradient up to 64 on planes of 32x32
    wide = 512 in direct_conv.WIDTHS
    assert len(seen) == (2 if wide else 0)
    assert [g for _, g in weight_grads] == ([(2, 64, 32, 32)] if wide else [])
    seen.clear()
    weight_grads.clear()
    run(256, 16)
    run(64, 32, stride=2)
    run(128, 8)
    run(16, 12)
    monkeypatch.setenv("HPCGRAD_DIRECT_CONV", "0")
    run(16, 32)
    assert seen == [] and weight_grads == []


def _node_run(x, w, b, padding, dilation, stride=1, groups=1):
    hx, hw = hg.tensor(x, requires_grad=True), hg.tensor(w, requires_grad=True)
    hb = hg.tensor(b, requires_grad=True)
    out = F.conv2d(hx, hw, hb, stride=stride, padding=padding, dilation=dilation, groups=groups)
    u = np.random.default_rng(1).standard_normal(out.shape).astype(x.dtype)
    (out * hg.tensor(u)).sum().backward()
    return out.array, hx.grad.array, hw.grad.array, hb.grad.array


def _viewed_case(seed, xs, ws, dtype):
    """An input of shape ``xs`` that is a transposed view, a weight of ``ws`` and a bias."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs[:2] + xs[3:1:-1]).astype(dtype).transpose(0, 1, 3, 2)
    return x, (rng.standard_normal(ws) * 0.1).astype(dtype), rng.standard_normal(ws[0]).astype(
        dtype)


def _agree(on, off, x, w, b, terms, **conv):
    """The Node's run ``on`` (output and three gradients) within 4 ``terms`` eps of ``off``'s
    and of PyTorch's conv2d(x, w, b, **conv) run the same way (where PyTorch is installed)."""
    atol = 4 * terms * np.finfo(x.dtype).eps

    def check(theirs, whose):
        for got, want, what in zip(on, theirs, ("output", "input gradient", "weight gradient",
                                                "bias gradient")):
            scale = np.abs(want).max() if want.size else 0
            np.testing.assert_allclose(got, want, rtol=0, atol=atol * max(scale, 1),
                                       err_msg=what + whose)
    check(off, "")
    torch = pytest.importorskip("torch")
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    out = torch.nn.functional.conv2d(tx, tw, tb, **conv)
    u = np.random.default_rng(1).standard_normal(tuple(out.shape)).astype(x.dtype)
    (out * torch.tensor(u)).sum().backward()
    check((out.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()),
          " (PyTorch)")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [((3, 5, 7, 13), (6, 5, 3, 3), 1, 1),
                                   ((2, 16, 32, 32), (16, 16, 3, 3), 1, 1),
                                   ((2, 3, 9, 10), (4, 3, 5, 5), 2, 1),
                                   ((2, 4, 8, 17), (5, 4, 1, 1), 0, 1),
                                   ((2, 4, 9, 14), (3, 4, 3, 3), 2, 2),
                                   ((0, 4, 8, 16), (4, 4, 3, 3), 1, 1)])
def test_the_node_with_the_kernel_matches_the_node_without(dtype, shape, monkeypatch,
                                                           direct_everywhere):
    """Forward, input, weight and bias gradients, the input a non-contiguous view (the Node
    makes it contiguous), the direct kernels on and off."""
    xs, ws, padding, dilation = shape
    rng = np.random.default_rng(2)
    x = rng.standard_normal(xs[:2] + xs[3:1:-1]).astype(dtype).transpose(0, 1, 3, 2)
    w = rng.standard_normal(ws).astype(dtype)
    b = rng.standard_normal(ws[0]).astype(dtype)
    weight_grads = []
    seen = _spy(monkeypatch, weight_grads)
    on = _node_run(x, w, b, padding, dilation)
    assert (seen and weight_grads) or xs[0] == 0
    monkeypatch.setenv("HPCGRAD_DIRECT_CONV", "0")
    off = _node_run(x, w, b, padding, dilation)
    terms = max(xs[1] * ws[2] * ws[3], ws[0] * ws[2] * ws[3], xs[0] * xs[2] * xs[3]) + 1
    rtol = 4 * terms * np.finfo(dtype).eps
    for got, want, what in zip(on, off, ("output", "input gradient", "weight gradient",
                                         "bias gradient")):
        scale = np.abs(want).max() if want.size else 0
        np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(scale, 1), err_msg=what)


def test_gradcheck_through_the_node_with_the_kernel(direct_everywhere):
    rng = np.random.default_rng(3)
    x = hg.tensor(rng.standard_normal((2, 3, 5, 6)), requires_grad=True)
    w = hg.tensor(rng.standard_normal((4, 3, 3, 3)), requires_grad=True)
    b = hg.tensor(rng.standard_normal(4), requires_grad=True)
    assert gradcheck(lambda x, w, b: F.conv2d(x, w, b, padding=1), (x, w, b))
    assert gradcheck(lambda x, w: F.conv2d(x, w, padding=(2, 1), dilation=(2, 1)), (x, w))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_node_with_the_kernel_matches_torch(dtype, direct_everywhere):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 16, 32, 32)).astype(dtype)
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(dtype)
    b = rng.standard_normal(16).astype(dtype)
    ours = _node_run(x, w, b, 1, 1)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    out = torch.nn.functional.conv2d(tx, tw, tb, padding=1)
    u = np.random.default_rng(1).standard_normal(tuple(out.shape)).astype(dtype)
    (out * torch.tensor(u)).sum().backward()
    theirs = (out.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy())
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for got, want in zip(ours, theirs):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [((4, 16, 32, 32), (32, 16, 3, 3), 1, 2),  # ResNet-18's
                                   ((4, 16, 32, 32), (32, 16, 1, 1), 0, 2),  # ... shortcut
                                   ((2, 5, 33, 31), (6, 5, 3, 3), 1, 2),
                                   ((2, 4, 48, 50), (3, 4, 5, 5), 2, 3)])
def test_the_strided_node_with_the_kernels_matches_the_node_without_and_torch(
        dtype, shape, monkeypatch, direct_everywhere):
    """At stride 2 and 3 the forward and, at 512 bits where the output's rows are whole
    vectors, the weight gradient go through the input's phases: the same values as the
    columns' path (HPCGRAD_DIRECT_CONV=0) and as PyTorch's, the input a transposed view."""
    xs, ws, padding, stride = shape
    x, w, b = _viewed_case(8, xs, ws, dtype)
    weight_grads = []
    seen = _spy(monkeypatch, weight_grads)
    on = _node_run(x, w, b, padding, 1, stride)
    assert seen
    wo = (xs[3] + 2 * padding - ws[3]) // stride + 1
    lanes = 512 // (8 * np.dtype(dtype).itemsize)
    wide = 512 in direct_conv.WIDTHS and wo % lanes == 0
    if ws[2:] == (1, 1):  # Note [Strided 1x1 convolutions]: the stride-1 kernels, subsampled
        assert [len(entry) for entry in seen + weight_grads] == [2, 2]
    else:
        assert [s for _, _, s in weight_grads] == ([(stride, stride)] if wide else [])
    monkeypatch.setenv("HPCGRAD_DIRECT_CONV", "0")
    off = _node_run(x, w, b, padding, 1, stride)
    terms = max(xs[1] * ws[2] * ws[3], ws[0] * ws[2] * ws[3], xs[0] * xs[2] * xs[3]) + 1
    _agree(on, off, x, w, b, terms, stride=stride, padding=padding)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [((4, 16, 32, 32), (32, 16, 1, 1), (2, 2), 1),  # ResNet-18's
                                   ((3, 6, 17, 33), (5, 6, 1, 1), (2, 3), 1),  # odd sizes
                                   ((2, 8, 16, 16), (8, 4, 1, 1), (2, 2), 2),  # groups
                                   ((3, 5, 9, 12), (4, 5, 1, 1), (3, 1), 1),
                                   ((0, 4, 8, 16), (4, 4, 1, 1), (2, 2), 1)])  # empty batch
def test_a_strided_1x1_convolution_is_the_stride_1_one_of_the_positions_it_reads(
        dtype, shape, monkeypatch, direct_everywhere):
    """Note [Strided 1x1 convolutions]: forward and the three gradients with the subsampled
    input through the stride-1 kernels equal the strided path's (``_SUBSAMPLE_1X1 = False``)
    within the sums' rounding bound, and PyTorch's; the input a transposed view."""
    xs, ws, stride, groups = shape
    x, w, b = _viewed_case(9, xs, ws, dtype)
    weight_grads = []
    seen = _spy(monkeypatch, weight_grads)
    on = _node_run(x, w, b, 0, 1, stride, groups)
    if groups == 1 and xs[0]:  # (the direct kernels take one group)
        assert [len(entry) for entry in seen + weight_grads] == [2, 2]  # stride 1, subsampled
    monkeypatch.setattr(_conv, "_SUBSAMPLE_1X1", False)
    off = _node_run(x, w, b, 0, 1, stride, groups)
    _agree(on, off, x, w, b, max(xs[1], ws[0], xs[0] * xs[2] * xs[3]) + 1, stride=stride,
           groups=groups)
