"""In-place relu_ and residual add_ folded into BatchNorm's Node (autograd/fold.py, Note [Folded
in-place ops]): the same bits as every op recorded (``fold.ENABLED = False``), PyTorch's values,
gradcheck in float64, and the cases that must be recorded as usual."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad import nn
from hpcgrad.autograd import fold, gradcheck, gradgradcheck

_spec = importlib.util.spec_from_file_location(
    "_benchmark_models", Path(__file__).parents[2] / "benchmarks" / "models.py")
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)


def _block(lib, width, stride, rng, dtype):
    """torchvision's BasicBlock (ReLU(inplace=True), ``out += identity``), weights from rng:
    benchmarks/models.py's, the block the ResNet-18 figures time."""
    Block = _models.basic_block(lib)
    block = Block(width, width, stride)
    if dtype == "float64":
        block = block.double()
    for p in block.parameters():
        p.data = lib.tensor(rng.uniform(-0.5, 0.5, tuple(p.shape)).astype(dtype))
    return block


def _train(enabled, dtype="float32", stride=1, steps=3, eval_last=False, lib=hg):
    """Outputs, input gradient and parameters after ``steps`` SGD steps of a block."""
    fold.ENABLED = enabled
    try:
        rng = np.random.default_rng(5)
        block = _block(lib, 4, stride, rng, dtype)
        opt = lib.optim.SGD(block.parameters(), lr=0.1, momentum=0.9)
        seen = []
        for step in range(steps):
            if eval_last and step == steps - 1:
                block.eval()
            x = lib.tensor(rng.standard_normal((3, 4, 6, 6)).astype(dtype), requires_grad=True)
            out = block(x)
            opt.zero_grad()
            (out * lib.tensor(rng.standard_normal(tuple(out.shape)).astype(dtype))).sum().backward()
            opt.step()
            seen += [out.detach().numpy().copy(), x.grad.numpy().copy()]
            if lib is hg:
                seen.append(type(out.grad_fn).__name__)
        return seen + [p.detach().numpy().copy() for p in block.parameters()]
    finally:
        fold.ENABLED = True


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("eval_last", [False, True])
def test_a_resnet_block_folded_gives_the_bits_of_every_op_recorded(dtype, stride, eval_last):
    folded, recorded = _train(True, dtype, stride, eval_last=eval_last), \
        _train(False, dtype, stride, eval_last=eval_last)
    assert folded[2] == "BatchNormBackward0" and recorded[2] == "ReluBackward0"
    for a, b in zip(folded, recorded):
        if isinstance(a, str):
            continue
        np.testing.assert_array_equal(a, b)


def test_a_resnet_block_folded_matches_torch():
    torch = pytest.importorskip("torch")
    ours, theirs = _train(True, "float64", 2), _train(True, "float64", 2, lib=torch)
    ours = [a for a in ours if not isinstance(a, str)]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


def _tail(x, residual, w, b, training=True, relu_first=False):
    """F.batch_norm of x, then ``+= residual`` and relu_ (or relu_ then the add)."""
    rm, rv = hg.tensor(np.zeros(x.shape[1])), hg.tensor(np.ones(x.shape[1]))
    out = F.batch_norm(x * 1, rm, rv, w, b, training=training, momentum=0.0)
    if relu_first:
        out.relu_()
        out += residual
    else:
        out += residual
        out.relu_()
    return out


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_through_the_folded_node(training):
    rng = np.random.default_rng(3)
    x = hg.tensor(rng.standard_normal((3, 2, 5)), requires_grad=True)
    r = hg.tensor(rng.standard_normal((3, 2, 5)), requires_grad=True)
    w = hg.tensor(rng.uniform(0.5, 2, 2), requires_grad=True)
    b = hg.tensor(rng.standard_normal(2), requires_grad=True)
    assert type(_tail(x, r, w, b, training).grad_fn).__name__ == "BatchNormBackward0"

    def fn(x, r, w, b):
        return _tail(x, r, w, b, training)

    assert gradcheck(fn, (x, r, w, b))
    assert gradgradcheck(fn, (x, r, w, b))  # create_graph: the folded mask by differentiable ops


def test_the_empty_batch_and_a_non_contiguous_residual():
    rng = np.random.default_rng(4)
    w = hg.tensor(rng.uniform(0.5, 2, 3), requires_grad=True)
    b = hg.tensor(rng.standard_normal(3), requires_grad=True)
    for enabled in (True, False):
        fold.ENABLED = enabled
        try:
            x = hg.tensor(np.zeros((0, 3, 4)), requires_grad=True)
            out = _tail(x, hg.tensor(np.zeros((0, 3, 4))), w, b, training=False)
            out.sum().backward()
            assert x.grad.shape == (0, 3, 4) and out.shape == (0, 3, 4)
        finally:
            fold.ENABLED = True
    results = []
    for enabled in (True, False):
        fold.ENABLED = enabled
        rng = np.random.default_rng(14)
        try:
            x = hg.tensor(rng.standard_normal((2, 3, 4, 5)), requires_grad=True)
            r = hg.tensor(rng.standard_normal((2, 3, 5, 4)), requires_grad=True)
            out = _tail(x, r.transpose(2, 3), w, b)
            (out * out).sum().backward()
            results.append((type(out.grad_fn).__name__, out.array.copy(), x.grad.array.copy(),
                            r.grad.array.copy()))
        finally:
            fold.ENABLED = True
        w.grad = b.grad = None
    assert results[0][0] == "BatchNormBackward0" and results[1][0] == "ReluBackward0"
    for a, b_ in zip(results[0][1:], results[1][1:]):
        np.testing.assert_array_equal(a, b_)


def _uses(kind):
    """A BN output used in a way that must keep every op recorded; returns (name of out's
    grad_fn, values)."""
    rng = np.random.default_rng(9)
    x = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    r = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    bn = nn.BatchNorm1d(3)
    out = bn(x)
    extra = 0
    if kind == "used before":
        extra = (out * 3).sum()
    elif kind == "a view used":
        extra = out[0].sum()
    elif kind == "grad_fn held":
        held = out.grad_fn  # noqa: F841  (a user may add to the Node it sees)
    elif kind == "hook":
        out.register_hook(lambda g: g * 2)
    elif kind == "retain_grad":
        out.retain_grad()
    if kind == "alpha":
        out.add_(r, alpha=2.0)
    else:
        out += r
    out.relu_()
    ((out * out).sum() + extra).backward()
    values = [out.array, x.grad.array, r.grad.array, bn.weight.grad.array]
    if kind == "retain_grad":
        values.append(out.grad.array)
    return type(out.grad_fn).__name__, values


@pytest.mark.parametrize("kind", ["used before", "a view used", "grad_fn held", "hook",
                                  "retain_grad", "alpha"])
def test_an_output_seen_elsewhere_is_not_folded(kind):
    name, folded = _uses(kind)
    fold.ENABLED = False
    try:
        _, recorded = _uses(kind)
    finally:
        fold.ENABLED = True
    assert name == "ReluBackward0"
    for a, b in zip(folded, recorded):
        np.testing.assert_array_equal(a, b)


def test_a_write_into_the_saved_input_before_the_fold_still_raises():
    """BatchNorm's input written in place after the forward, before the folded relu_: the fold
    keeps the version the input was saved at, so backward raises, folded or not."""
    for enabled in (True, False):
        fold.ENABLED = enabled
        try:
            rng = np.random.default_rng(8)
            h = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True) * 1
            out = F.batch_norm(h, None, None, training=True)
            h.add_(1.0)
            out += hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
            out.relu_()
            assert type(out.grad_fn).__name__ == ("BatchNormBackward0" if enabled
                                                  else "ReluBackward0")
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        finally:
            fold.ENABLED = True


@pytest.mark.parametrize("second", ["relu first", "twice", "written after"])
def test_a_write_into_the_folded_output_raises_at_backward_as_pytorch(second):
    """ReLU's saved output, written in place after: PyTorch raises at backward; so does the
    folded Node, whose saved output is version-checked the same way."""
    rng = np.random.default_rng(2)
    x = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    r = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    w, b = hg.tensor(np.ones(3), requires_grad=True), hg.tensor(np.zeros(3), requires_grad=True)
    out = _tail(x, r, w, b, relu_first=second == "relu first")
    if second == "twice":
        out.relu_()
    elif second == "written after":
        out += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_the_folded_node_shows_the_residual_edge():
    rng = np.random.default_rng(1)
    x = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    r = hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True)
    w, b = hg.tensor(np.ones(3), requires_grad=True), hg.tensor(np.zeros(3), requires_grad=True)
    residual = r * 2
    out = _tail(x, residual, w, b)
    assert type(out.grad_fn).__name__ == "BatchNormBackward0"
    assert out.grad_fn.next_functions[-1] == (residual.grad_fn, 0)
    assert out.grad_fn.topological_nr > residual.grad_fn.topological_nr
    # a residual that needs no gradient leaves the last edge empty
    out = _tail(x, hg.tensor(rng.standard_normal((2, 3, 4))), w, b)
    assert out.grad_fn.next_functions[-1] == (None, 0)
    out.sum().backward()
    assert np.isfinite(x.grad.array).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_block_folds_the_same_way_in_both_forwards(reentrant):
    """Under torch.utils.checkpoint the block's forward runs twice (non-reentrant: the first
    with saved-tensor hooks, which turn folding off); the gradients are the recorded ops'."""
    from hpcgrad.utils.checkpoint import checkpoint

    def run(enabled):
        fold.ENABLED = enabled
        try:
            hg.manual_seed(0)
            rng = np.random.default_rng(0)
            bn, conv = nn.BatchNorm2d(3), nn.Conv2d(3, 3, 3, padding=1)

            def f(x):
                out = bn(conv(x))
                out += x
                return F.relu(out, inplace=True)

            x = hg.tensor(rng.standard_normal((2, 3, 5, 5)), requires_grad=True)
            y = checkpoint(f, x, use_reentrant=reentrant)
            (y * y).sum().backward()
            return [x.grad.array, conv.weight.grad.array, bn.weight.grad.array]
        finally:
            fold.ENABLED = True

    for a, b in zip(run(True), run(False)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_a_folded_block_on_the_gpu(monkeypatch):
    """With the CUDA BatchNorm kernels (opt-in), the folds happen on cupy arrays too: the bits
    of every op recorded there, the CPU's values."""
    monkeypatch.setenv("HPCGRAD_CUDA_NORMS", "1")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    r = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    g = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    runs = {}
    for device, enabled in (("cuda:0", True), ("cuda:0", False), ("cpu", True)):
        fold.ENABLED = enabled
        try:
            xt = hg.tensor(x, requires_grad=True).to(device)
            xt.retain_grad()
            rt = hg.tensor(r, requires_grad=True).to(device)
            rt.retain_grad()
            w = hg.tensor(np.linspace(0.5, 2, 4, dtype=np.float32), requires_grad=True)
            out = F.batch_norm(xt * 1, None, None, w.to(device), None, training=True)
            out += rt
            out.relu_()
            (out * hg.tensor(g).to(device)).sum().backward()
            runs[(device, enabled)] = (type(out.grad_fn).__name__, [
                out.detach().cpu().numpy(), xt.grad.cpu().numpy(), rt.grad.cpu().numpy()])
        finally:
            fold.ENABLED = True
    assert runs[("cuda:0", True)][0] == "BatchNormBackward0"
    for a, b, c in zip(runs[("cuda:0", True)][1], runs[("cuda:0", False)][1],
                       runs[("cpu", True)][1]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
