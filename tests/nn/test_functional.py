"""nn.functional: gradients against finite differences (float64), second derivatives, errors."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck

RNG = np.random.default_rng(0)


def _randn(*shape):
    return RNG.standard_normal(shape)


def _distinct(*shape):
    """Well-separated values, so finite differences never swap the maximum of a window."""
    return RNG.permutation(np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape) * 0.1


LABELS = np.array([1, 0, 3, 2, 1])
MAP_LABELS = np.array([[[0, 2], [1, -100]], [[2, 2], [0, 1]]])  # (N, d1, d2), one ignored
EMB_IDX = np.array([[0, 2, 2], [4, 0, 1]])
RUNNING = (_randn(2), np.abs(_randn(2)) + 0.5)  # running mean and var for eval-mode batch_norm


def _seeded_dropout(x):
    hg.manual_seed(7)  # the same mask on every call gradcheck makes
    return F.dropout(x, 0.4, training=True)


# name -> (fn(*tensors), arrays); every array becomes a float64 tensor that requires grad
CASES = {
    "linear": (lambda x, w, b: F.linear(x, w, b), (_randn(3, 4), _randn(2, 4), _randn(2))),
    "linear_3d_nobias": (lambda x, w: F.linear(x, w), (_randn(2, 3, 4), _randn(2, 4))),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b), (_randn(2, 2, 5, 5), _randn(3, 2, 3, 3),
                                                    _randn(3))),
    "conv2d_stride2_pad1": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
                            (_randn(1, 2, 5, 6), _randn(2, 2, 3, 3), _randn(2))),
    "conv2d_stride_pad_pairs": (lambda x, w: F.conv2d(x, w, stride=(1, 2), padding=(2, 0)),
                                (_randn(1, 1, 4, 5), _randn(2, 1, 2, 3))),
    "conv2d_overlap_stride2_k4": (lambda x, w: F.conv2d(x, w, stride=2),
                                  (_randn(1, 1, 7, 7), _randn(1, 1, 4, 4))),
    "conv2d_dilation_same": (lambda x, w: F.conv2d(x, w, padding="same", dilation=2),
                             (_randn(1, 1, 5, 5), _randn(1, 1, 2, 3))),
    "conv2d_unbatched": (lambda x, w: F.conv2d(x, w, padding=1),
                         (_randn(2, 3, 3), _randn(1, 2, 3, 3))),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), (_distinct(2, 2, 4, 4),)),
    "max_pool2d_overlap": (lambda x: F.max_pool2d(x, 3, stride=1), (_distinct(1, 2, 5, 5),)),
    "max_pool2d_pad_ceil": (lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
                            (_distinct(1, 1, 6, 5),)),
    "max_pool2d_dilation": (lambda x: F.max_pool2d(x, 2, stride=1, dilation=2),
                            (_distinct(1, 1, 5, 5),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), (_randn(3, 4), _randn(4),
                                                                  _randn(4))),
    "layer_norm_2d": (lambda x: F.layer_norm(x, (2, 3)), (_randn(2, 2, 3),)),
    "batch_norm_train_2d": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                            (_randn(3, 2, 2, 2), _randn(2), _randn(2))),
    "batch_norm_train_1d": (lambda x: F.batch_norm(x, None, None, training=True),
                            (_randn(4, 3),)),
    "batch_norm_eval": (lambda x, w: F.batch_norm(x, hg.tensor(RUNNING[0]), hg.tensor(RUNNING[1]),
                                                  w, training=False),
                        (_randn(3, 2, 2), _randn(2))),
    "embedding": (lambda w: F.embedding(EMB_IDX, w), (_randn(5, 3),)),
    "cross_entropy": (lambda x: F.cross_entropy(x, LABELS), (_randn(5, 4),)),
    "cross_entropy_sum_ignore": (lambda x: F.cross_entropy(x, np.array([1, -100, 3, 2, 1]),
                                                           reduction="sum"), (_randn(5, 4),)),
    "cross_entropy_smooth_weight": (lambda x: F.cross_entropy(
        x, LABELS, weight=hg.tensor([1.0, 2.0, 0.5, 1.5], dtype=np.float64),
        label_smoothing=0.2), (_randn(5, 4),)),
    "cross_entropy_spatial_none": (lambda x: F.cross_entropy(x, MAP_LABELS, reduction="none"),
                                   (_randn(2, 3, 2, 2),)),
    "cross_entropy_probabilities": (lambda x: F.cross_entropy(x, np.full((5, 4), 0.25)),
                                    (_randn(5, 4),)),
    "nll_loss": (lambda x: F.nll_loss(x, LABELS), (_randn(5, 4),)),
    "nll_loss_weight_none": (lambda x: F.nll_loss(x, LABELS, weight=np.array([1.0, 2, 3, 4]),
                                                  reduction="none"), (_randn(5, 4),)),
    "mse_loss": (lambda x, y: F.mse_loss(x, y), (_randn(3, 4), _randn(3, 4))),
    "mse_loss_sum": (lambda x, y: F.mse_loss(x, y, reduction="sum"), (_randn(3, 4),
                                                                      _randn(3, 4))),
    "dropout_seeded": (_seeded_dropout, (_randn(4, 5),)),
    "pad_and_crop": (lambda x: F.pad(x, (1, 2, -1, 1), value=0.5), (_randn(2, 3, 4),)),
    "gelu": (lambda x: F.gelu(x), (_randn(3, 4),)),
    "softmax": (lambda x: F.softmax(x, 1), (_randn(3, 4),)),
}

# Double backward through the Functions this package adds (im2col/col2im, pad, max-pool, linear).
SECOND_ORDER = ["linear", "conv2d_stride2_pad1", "max_pool2d_pad_ceil", "embedding",
                "cross_entropy_smooth_weight", "layer_norm", "batch_norm_train_1d"]


def check(name, order=1):
    """gradcheck (or gradgradcheck) of CASES[name] on fresh float64 leaves."""
    fn, arrays = CASES[name]
    inputs = [hg.tensor(a.copy(), dtype=np.float64, requires_grad=True) for a in arrays]
    (gradcheck if order == 1 else gradgradcheck)(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck(name):
    check(name)


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_gradgradcheck(name):
    check(name, order=2)


def test_dropout_mask_statistics_seed_and_eval():
    x = hg.ones(200, 100)
    hg.manual_seed(3)
    a = F.dropout(x, 0.3).array
    hg.manual_seed(3)
    b = F.dropout(x, 0.3).array
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.unique(a), [0.0, 1 / 0.7], rtol=1e-6)
    assert abs((a == 0).mean() - 0.3) < 0.02
    assert F.dropout(x, 0.3, training=False) is x
    np.testing.assert_array_equal(F.dropout(x, 1.0).array, 0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(x, 1.5)


def test_conv2d_matches_a_direct_loop():
    x, w, b = _randn(2, 3, 6, 5), _randn(4, 3, 3, 2), _randn(4)
    out = F.conv2d(hg.tensor(x), hg.tensor(w), hg.tensor(b), stride=(2, 1), padding=1).array
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.empty(out.shape)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            patch = xp[:, :, 2 * i:2 * i + 3, j:j + 2]
            want[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_col2im_sums_overlapping_windows():
    from hpcgrad.nn._window import Col2Im, Im2Col
    x = hg.tensor(np.arange(30.0).reshape(1, 1, 5, 6))
    args = ((3, 2), (1, 2), (1, 1))
    cols = Im2Col.apply(x, *args)
    assert cols.shape == (1, 3 * 2, 3 * 3)  # (N, C*kh*kw, Ho*Wo)
    counts = Col2Im.apply(hg.ones(*cols.shape, dtype=np.float64), x.shape, *args).array
    # each row is covered by up to 3 windows (kernel 3, stride 1); columns by exactly 1
    np.testing.assert_array_equal(counts[0, 0, :, 0], [1, 2, 3, 2, 1])
    np.testing.assert_array_equal(Col2Im.apply(cols, x.shape, *args).array, x.array * counts)


@pytest.mark.parametrize("call, error, match", [
    (lambda: F.conv2d(hg.zeros(1, 2, 5, 5), hg.zeros(3, 1, 3, 3)), RuntimeError,
     r"expected input\[1, 2, 5, 5\] to have 1 channels, but got 2"),
    (lambda: F.conv2d(hg.zeros(1, 1, 2, 2), hg.zeros(1, 1, 3, 3)), RuntimeError,
     "smaller than the"),
    (lambda: F.conv2d(hg.zeros(1, 1, 5, 5), hg.zeros(1, 1, 3, 3), stride=2, padding="same"),
     ValueError, "strided"),
    (lambda: F.max_pool2d(hg.zeros(1, 1, 4, 4), 2, padding=2), RuntimeError, "at most half"),
    (lambda: F.cross_entropy(hg.zeros(3, 4), np.array([0, 4, 1])), IndexError,
     "Target 4 is out of bounds"),
    (lambda: F.cross_entropy(hg.zeros(3, 4), np.array([0, 1])), ValueError,
     r"batch_size \(3\) to match target batch_size \(2\)"),
    (lambda: F.cross_entropy(hg.zeros(3, 4), LABELS[:3], reduction="avg"), ValueError,
     "avg is not a valid value for reduction"),
    (lambda: F.embedding(np.array([5]), hg.zeros(5, 2)), IndexError, "index out of range"),
    (lambda: F.embedding(np.array([0.0]), hg.zeros(5, 2)), TypeError, "integers"),
    (lambda: F.layer_norm(hg.zeros(2, 3), (4,)), RuntimeError, r"normalized_shape=\[4\]"),
    (lambda: F.batch_norm(hg.zeros(1, 3), None, None, training=True), ValueError,
     "more than 1 value per channel"),
    (lambda: F.pad(hg.zeros(2, 2), (1,)), ValueError, "divisible by 2"),
])
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
