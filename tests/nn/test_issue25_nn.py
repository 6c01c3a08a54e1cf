"""Issue 25, nn: empty batches, F.pad's copy, softmax of empty tensors, version checks of saved
inputs; each beside PyTorch CPU (skipped without torch)."""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn
import hpcgrad.nn.functional as F

HG = SimpleNamespace(nn=hnn, F=F, tensor=hg.tensor, long=np.int64)


def _torch_lib(torch):
    return SimpleNamespace(nn=torch.nn, F=torch.nn.functional, tensor=torch.tensor,
                           long=torch.int64)


def _numpy(t):
    return t.detach().numpy() if hasattr(t, "detach") and not hasattr(t, "_data") else t.array


def _empty_batch_run(lib, make, shape, train, state):
    """Forward and backward of a module on zeros of ``shape`` (a 0-sized batch); returns the
    output, the input gradient, the parameter gradients and the buffers, as arrays."""
    module = make(lib).double()
    if state is not None:
        module.load_state_dict(state)
    module.train(train)
    x = lib.tensor(np.zeros(shape), requires_grad=True)
    out = module(x)
    out.sum().backward()
    grads = {name: _numpy(p.grad) for name, p in module.named_parameters()}
    buffers = {name: _numpy(b) for name, b in module.named_buffers()}
    return _numpy(out), _numpy(x.grad), grads, buffers, module.state_dict()


EMPTY_BATCH = {
    "conv2d_stride1_pad1": (lambda L: L.nn.Conv2d(3, 4, 3, padding=1), (0, 3, 5, 5)),
    "conv2d_stride1_nopad": (lambda L: L.nn.Conv2d(3, 4, 2), (0, 3, 5, 5)),
    "conv2d_stride2": (lambda L: L.nn.Conv2d(3, 4, 3, stride=2, padding=1), (0, 3, 5, 5)),
    "batchnorm2d": (lambda L: L.nn.BatchNorm2d(3), (0, 3, 4, 4)),
    "batchnorm2d_cumulative": (lambda L: L.nn.BatchNorm2d(3, momentum=None), (0, 3, 4, 4)),
    "batchnorm2d_empty_spatial": (lambda L: L.nn.BatchNorm2d(3), (2, 3, 0, 4)),
    "batchnorm1d_nc": (lambda L: L.nn.BatchNorm1d(3), (0, 3)),
    "batchnorm1d_ncl": (lambda L: L.nn.BatchNorm1d(3, affine=False), (0, 3, 5)),
    "batchnorm1d_no_stats": (lambda L: L.nn.BatchNorm1d(3, track_running_stats=False),
                             (0, 3)),
    "linear": (lambda L: L.nn.Linear(3, 4), (0, 3)),
    "maxpool2d": (lambda L: L.nn.MaxPool2d(2), (0, 3, 4, 4)),
    "conv_bn_relu_pool": (lambda L: L.nn.Sequential(L.nn.Conv2d(2, 3, 3, padding=1),
                                                    L.nn.BatchNorm2d(3), L.nn.ReLU(),
                                                    L.nn.MaxPool2d(2)), (0, 2, 4, 4)),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", sorted(EMPTY_BATCH))
def test_empty_batch_forward_and_backward_match_torch(name, train):
    torch = pytest.importorskip("torch")
    make, shape = EMPTY_BATCH[name]
    ours = _empty_batch_run(HG, make, shape, train, None)
    # torch's module gets our parameters, and running statistics away from 0 and 1, so that a
    # step that touched them would show
    state = {k: torch.from_numpy(np.array(v.data + 0.5 if "running" in k else v.data))
             for k, v in ours[4].items()}
    ours = _empty_batch_run(HG, make, shape, train,
                            {k: hg.tensor(v.numpy()) for k, v in state.items()})
    want = _empty_batch_run(_torch_lib(torch), make, shape, train, state)
    for got, expected in zip(ours[:2], want[:2]):
        assert got.shape == expected.shape and got.dtype == expected.dtype
    assert ours[2].keys() == want[2].keys()
    for k in want[2]:  # parameter gradients: zeros of the parameter's shape, as torch's
        np.testing.assert_array_equal(ours[2][k], want[2][k], err_msg=k)
    assert ours[3].keys() == want[3].keys()
    for k in want[3]:  # running statistics untouched, num_batches_tracked counted
        np.testing.assert_array_equal(ours[3][k], want[3][k], err_msg=k)


@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_empty_batch_loss_matches_torch(fn):
    torch = pytest.importorskip("torch")
    results = []
    for lib in (HG, _torch_lib(torch)):
        x = lib.tensor(np.zeros((0, 4)), requires_grad=True)
        loss = getattr(lib.F, fn)(x, lib.tensor(np.zeros(0, np.int64)))
        loss.backward()
        results.append((_numpy(loss), _numpy(x.grad)))
    (loss, grad), (want_loss, want_grad) = results
    np.testing.assert_array_equal(loss, want_loss)  # NaN: a mean over no samples
    assert grad.shape == want_grad.shape == (0, 4)


def test_functional_batch_norm_train_empty_batch_without_running_stats():
    torch = pytest.importorskip("torch")
    w = np.array([1.5, -0.5])
    outs = []
    for lib in (HG, _torch_lib(torch)):
        x = lib.tensor(np.zeros((0, 2, 3)), requires_grad=True)
        weight = lib.tensor(w.copy(), requires_grad=True)
        y = lib.F.batch_norm(x, None, None, weight, None, training=True)
        y.sum().backward()
        outs.append((_numpy(y).shape, _numpy(x.grad).shape, _numpy(weight.grad)))
    assert outs[0][:2] == outs[1][:2]
    np.testing.assert_array_equal(outs[0][2], outs[1][2])


# --- F.pad returns a new Tensor -------------------------------------------------------------
@pytest.mark.parametrize("widths", [(0, 0), (0, 0, 0, 0), (-1, 0), (0, -1, -1, 0)],
                         ids=["zero", "zero_2d", "crop", "crop_2d"])
def test_pad_without_growth_returns_a_copy(widths):
    torch = pytest.importorskip("torch")
    results = []
    for lib in (HG, _torch_lib(torch)):
        x = lib.tensor(np.arange(12.0).reshape(3, 4), requires_grad=True)
        y = lib.F.pad(x, widths)
        assert y is not x and y.grad_fn is not None
        y.mul_(10.0)  # must reach neither x's values nor its gradient's formula
        (y * lib.tensor(np.arange(y.numel(), dtype=np.float64).reshape(tuple(y.shape)))
         ).sum().backward()
        results.append((_numpy(x), _numpy(y), _numpy(x.grad)))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


def test_pad_zero_of_a_plain_tensor_does_not_share_memory():
    x = hg.tensor(np.arange(6.0).reshape(2, 3))
    y = F.pad(x, (0, 0))
    y.add_(1.0)
    np.testing.assert_array_equal(x.array, np.arange(6.0).reshape(2, 3))


# --- softmax of empty tensors ---------------------------------------------------------------
@pytest.mark.parametrize("shape, dim", [((0, 3), 0), ((0, 3), 1), ((3, 0), 0), ((3, 0), 1),
                                        ((0,), 0), ((2, 0, 3), -1)])
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_softmax_of_an_empty_tensor_matches_torch(fn, shape, dim):
    torch = pytest.importorskip("torch")
    results = []
    for lib in (HG, _torch_lib(torch)):
        x = lib.tensor(np.zeros(shape, np.float32), requires_grad=True)
        y = getattr(lib.F, fn)(x, dim)
        y.sum().backward()
        results.append((_numpy(y), _numpy(x.grad)))
    for got, want in zip(*results):
        assert got.shape == want.shape and got.dtype == want.dtype


# --- version checks of saved inputs ---------------------------------------------------------
def _write_after_forward(lib, fn):
    """fn(lib, x) with x a non-leaf; x written in place after the forward; then backward.
    Returns the error message, or None if backward ran."""
    leaf = lib.tensor(np.random.default_rng(0).standard_normal((4, 2, 4, 4)),
                      requires_grad=True)
    x = leaf * 1.0
    y = fn(lib, x)
    x.add_(1.0)
    try:
        y.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


SAVES_INPUT = {
    "batch_norm_train": lambda L, x: L.F.batch_norm(x, None, None, training=True),
    "batch_norm_train_affine": lambda L, x: L.F.batch_norm(
        x, None, None, L.tensor(np.array([2.0, 3.0])), L.tensor(np.array([0.5, 1.0])),
        training=True),
    "batch_norm_eval": lambda L, x: L.F.batch_norm(
        x, L.tensor(np.array([0.1, -0.2])), L.tensor(np.array([1.5, 0.5])), training=False),
    "max_pool2d": lambda L, x: L.F.max_pool2d(x, 2),
    "max_pool2d_indices": lambda L, x: L.F.max_pool2d(x, 3, stride=1, padding=1,
                                                      return_indices=True)[0],
}


@pytest.mark.parametrize("name", sorted(SAVES_INPUT))
def test_saved_input_written_in_place_raises_as_torch(name):
    torch = pytest.importorskip("torch")
    want = _write_after_forward(_torch_lib(torch), SAVES_INPUT[name])
    assert want is not None and "modified by an inplace operation" in want
    got = _write_after_forward(HG, SAVES_INPUT[name])
    assert got is not None and "modified by an inplace operation" in got, got


@pytest.mark.parametrize("name", sorted(SAVES_INPUT))
def test_saved_input_not_written_gives_torchs_gradient(name):
    torch = pytest.importorskip("torch")
    grads = []
    for lib in (HG, _torch_lib(torch)):
        leaf = lib.tensor(np.random.default_rng(1).standard_normal((4, 2, 4, 4)),
                          requires_grad=True)
        y = SAVES_INPUT[name](lib, leaf * 1.0)
        (y * lib.tensor(np.random.default_rng(2).standard_normal(tuple(y.shape)))
         ).sum().backward()
        grads.append(_numpy(leaf.grad))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-10, atol=1e-12)
