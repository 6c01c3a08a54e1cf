"""Layers and losses beside PyTorch CPU in float64: outputs, input and parameter gradients, buffers.

Skipped when torch is not installed. Each case builds the same module from ``L.nn`` for both
libraries (hpcgrad's weights are copied into torch's through ``state_dict``); ``compare`` holds
the logic: a few training steps, then one step in eval mode.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn

torch = pytest.importorskip("torch")

HG = SimpleNamespace(nn=hnn, tensor=lambda a: hg.tensor(a))
TORCH = SimpleNamespace(nn=torch.nn, tensor=torch.from_numpy)


def _numpy(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else t.data


def _step(module, lib, x, target, seed):
    """Forward, backward of <output, v> for a random v drawn from ``seed``; returns the output,
    extra outputs and the input gradient."""
    diff = x.dtype.kind == "f"
    xt = lib.tensor(x.copy())
    if diff:
        xt.requires_grad_(True)
    out = module(xt) if target is None else module(xt, lib.tensor(target))
    extra = []
    if isinstance(out, tuple):  # (values, indices)
        out, extra = out[0], [_numpy(o) for o in out[1:]]
    upstream = np.random.default_rng(seed).standard_normal(tuple(out.shape))
    (out * lib.tensor(upstream)).sum().backward()
    return _numpy(out), extra, (_numpy(xt.grad) if diff else None)


def compare(make, x, target=None, steps=2, seed=0, rtol=1e-10, atol=1e-12):
    """make(L) -> module; same outputs, gradients and state_dict as torch over ``steps`` training
    steps (with fresh inputs scaled like ``x``), then the same output in eval mode."""
    ours, theirs = make(HG).double(), make(TORCH).double()
    ours_state = ours.state_dict()
    assert list(ours_state) == list(theirs.state_dict())
    theirs.load_state_dict({k: torch.from_numpy(v.array.copy()) for k, v in ours_state.items()})
    rng = np.random.default_rng(seed)
    for step in range(steps + 1):
        if step == steps:
            ours.eval()
            theirs.eval()
        xs = x if step == 0 or x.dtype.kind != "f" else x + rng.standard_normal(x.shape)
        out, extra, grad = _step(ours, HG, xs, target, seed + step)
        want, want_extra, want_grad = _step(theirs, TORCH, xs, target, seed + step)
        np.testing.assert_allclose(out, want, rtol=rtol, atol=atol)
        for e, w in zip(extra, want_extra):
            np.testing.assert_array_equal(e, w)
        if grad is not None:
            np.testing.assert_allclose(grad, want_grad, rtol=rtol, atol=atol)
        theirs_params = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            np.testing.assert_allclose(p.grad.array, _numpy(theirs_params[name].grad),
                                       rtol=rtol, atol=atol, err_msg=name)
        theirs_state = theirs.state_dict()
        for name, value in ours.state_dict().items():
            np.testing.assert_allclose(value.array, _numpy(theirs_state[name]), rtol=rtol,
                                       atol=atol, err_msg=name)
        ours.zero_grad()
        theirs.zero_grad()


RNG = np.random.default_rng(1)
IMG = RNG.standard_normal((2, 3, 7, 6))
LOGITS = RNG.standard_normal((6, 5))
LABELS = np.array([4, 0, 2, -100, 1, 1])

CASES = {
    "linear": (lambda L: L.nn.Linear(4, 3), RNG.standard_normal((5, 4))),
    "linear_3d_nobias": (lambda L: L.nn.Linear(4, 3, bias=False), RNG.standard_normal((2, 5, 4))),
    "conv2d": (lambda L: L.nn.Conv2d(3, 4, 3), IMG),
    "conv2d_stride2_pad1": (lambda L: L.nn.Conv2d(3, 4, 3, stride=2, padding=1), IMG),
    "conv2d_rect_nobias": (lambda L: L.nn.Conv2d(3, 2, (2, 3), stride=(2, 1), padding=(0, 2),
                                                 bias=False), IMG),
    "conv2d_dilation_same": (lambda L: L.nn.Conv2d(3, 2, 3, padding="same", dilation=2), IMG),
    "conv2d_k4_s3": (lambda L: L.nn.Conv2d(3, 2, 4, stride=3, padding=2), IMG),
    "maxpool2d": (lambda L: L.nn.MaxPool2d(2), IMG),
    "maxpool2d_s1_pad": (lambda L: L.nn.MaxPool2d(3, stride=1, padding=1), IMG),
    "maxpool2d_ties": (lambda L: L.nn.MaxPool2d(2, stride=1, return_indices=True),
                       np.round(IMG / 2)),
    "maxpool2d_nan": (lambda L: L.nn.MaxPool2d(3, stride=2, return_indices=True),
                      np.where(RNG.random(IMG.shape) < 0.1, np.nan, IMG)),
    "maxpool2d_ceil_indices": (lambda L: L.nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True,
                                                        return_indices=True), IMG),
    "maxpool2d_dilation": (lambda L: L.nn.MaxPool2d(2, stride=(1, 2), dilation=(2, 1)), IMG),
    "layernorm": (lambda L: L.nn.LayerNorm(6), IMG),
    "layernorm_2d_noaffine": (lambda L: L.nn.LayerNorm((7, 6), elementwise_affine=False), IMG),
    "batchnorm2d": (lambda L: L.nn.BatchNorm2d(3), IMG),
    "batchnorm2d_cumulative": (lambda L: L.nn.BatchNorm2d(3, momentum=None), IMG),
    "batchnorm2d_no_stats": (lambda L: L.nn.BatchNorm2d(3, track_running_stats=False), IMG),
    "batchnorm1d": (lambda L: L.nn.BatchNorm1d(4, momentum=0.3), RNG.standard_normal((5, 4))),
    "batchnorm1d_3d_noaffine": (lambda L: L.nn.BatchNorm1d(3, affine=False),
                                RNG.standard_normal((4, 3, 5))),
    "embedding": (lambda L: L.nn.Embedding(6, 3), np.array([[0, 5, 2], [2, 2, 1]])),
    "embedding_padding_freq": (lambda L: L.nn.Embedding(6, 3, padding_idx=-4,
                                                        scale_grad_by_freq=True),
                               np.array([[0, 5, 2], [2, 2, 1]])),
    "gelu": (lambda L: L.nn.GELU(), LOGITS),
    "gelu_tanh": (lambda L: L.nn.GELU("tanh"), LOGITS),
    "tanh": (lambda L: L.nn.Tanh(), LOGITS),
    "cnn": (lambda L: L.nn.Sequential(L.nn.Conv2d(3, 4, 3, padding=1), L.nn.BatchNorm2d(4),
                                      L.nn.ReLU(), L.nn.MaxPool2d(2), L.nn.Flatten(),
                                      L.nn.Linear(4 * 3 * 3, 5)), IMG),
}

LOSS_CASES = {
    "cross_entropy": (lambda L: L.nn.CrossEntropyLoss(), LABELS),
    "cross_entropy_sum": (lambda L: L.nn.CrossEntropyLoss(reduction="sum"), LABELS),
    "cross_entropy_none_ignore": (lambda L: L.nn.CrossEntropyLoss(reduction="none",
                                                                  ignore_index=1),
                                  np.array([4, 0, 2, 1, 1, 3])),
    "cross_entropy_weight_smoothing": (lambda L: L.nn.CrossEntropyLoss(
        weight=L.tensor(np.array([1.0, 2.0, 0.5, 1.5, 3.0])), label_smoothing=0.15), LABELS),
    "cross_entropy_probabilities": (lambda L: L.nn.CrossEntropyLoss(label_smoothing=0.1),
                                    np.random.default_rng(2).dirichlet(np.ones(5), 6)),
    "nll_loss_weight": (lambda L: L.nn.NLLLoss(weight=L.tensor(np.arange(1.0, 6.0))), LABELS),
    "mse_loss": (lambda L: L.nn.MSELoss(), RNG.standard_normal((6, 5))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_matches_torch(name):
    make, x = CASES[name]
    compare(make, x, steps=3 if "batchnorm" in name or name == "cnn" else 1)


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_matches_torch(name):
    make, target = LOSS_CASES[name]
    compare(make, LOGITS, target=target, steps=1)


def test_cross_entropy_spatial_targets_match_torch():
    logits = RNG.standard_normal((2, 4, 3, 3))
    target = RNG.integers(0, 4, (2, 3, 3))
    target[0, 1, 1] = -100
    compare(lambda L: L.nn.CrossEntropyLoss(label_smoothing=0.05), logits, target=target)
