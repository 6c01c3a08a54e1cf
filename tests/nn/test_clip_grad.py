"""clip_grad_norm_ and clip_grad_value_: beside torch.nn.utils (skipped without torch), by hand,
sparse gradients, the errors, and under DDP against a single-process full-batch run (mpi)."""

import math

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import nn
from hpcgrad.nn.utils import clip_grad_norm_, clip_grad_value_, get_total_norm
from hpcgrad.sparse import SparseCOOTensor

SHAPES = [(3, 4), (5,), (), (2, 1, 2)]


def _params(seed, dtype=np.float64, missing=2, scale=1.0):
    """Parameters with random gradients; parameter ``missing`` has none."""
    rng = np.random.default_rng(seed)
    params = []
    for k, shape in enumerate(SHAPES):
        p = hg.tensor(rng.standard_normal(shape).astype(dtype), requires_grad=True)
        if k != missing:
            p.grad = hg.tensor((rng.standard_normal(shape) * scale).astype(dtype))
        params.append(p)
    return params


def _torch_params(torch, params):
    out = []
    for p in params:
        t = torch.tensor(p.array, requires_grad=True)
        if p.grad is not None:
            t.grad = torch.tensor(p.grad.array.copy())
        out.append(t)
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("norm_type", [2.0, 1, math.inf, -math.inf, 0, 3.5, "inf"])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, dtype):
    torch = pytest.importorskip("torch")
    params = _params(0, dtype)
    tparams = _torch_params(torch, params)
    nt = float(norm_type)
    total = clip_grad_norm_(params, max_norm, norm_type=nt)
    want = torch.nn.utils.clip_grad_norm_(tparams, max_norm, norm_type=nt)
    rtol = 1e-12 if dtype == np.float64 else 1e-6
    assert total.dtype == dtype and total.shape == ()
    np.testing.assert_allclose(total.array, want.numpy(), rtol=rtol)
    for p, t in zip(params, tparams):
        assert (p.grad is None) == (t.grad is None)
        if p.grad is not None:
            assert p.grad.dtype == dtype
            np.testing.assert_allclose(p.grad.array, t.grad.numpy(), rtol=rtol, atol=1e-30)


def test_clip_grad_value_matches_torch():
    torch = pytest.importorskip("torch")
    params = _params(1)
    tparams = _torch_params(torch, params)
    assert clip_grad_value_(params, 0.3) is None
    torch.nn.utils.clip_grad_value_(tparams, 0.3)
    for p, t in zip(params, tparams):
        if p.grad is not None:
            np.testing.assert_array_equal(p.grad.array, t.grad.numpy())


def test_nonfinite_norm_matches_torch():
    torch = pytest.importorskip("torch")
    params = _params(2)
    params[0].grad.array[0, 0] = np.inf
    tparams = _torch_params(torch, params)
    total, want = clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(tparams, 1.0)
    assert np.isinf(total.item()) and np.isinf(want.item())
    for p, t in zip(params, tparams):
        if p.grad is not None:  # scaled by 1 / inf = 0 (and inf * 0 = nan), as torch
            np.testing.assert_array_equal(p.grad.array, t.grad.numpy())


# --- by hand ---------------------------------------------------------------------------------
def test_by_hand():
    a = hg.tensor(np.zeros(2), requires_grad=True)
    b = hg.tensor(np.zeros(1), requires_grad=True)
    a.grad, b.grad = hg.tensor([3.0, 0.0]), hg.tensor([4.0])
    total = clip_grad_norm_([a, b], max_norm=1.0)
    assert total.item() == 5.0
    np.testing.assert_allclose(a.grad.array, [3 / (5 + 1e-6), 0])
    np.testing.assert_allclose(b.grad.array, [4 / (5 + 1e-6)])
    # below max_norm: untouched (the coefficient is clamped at 1)
    a.grad = hg.tensor(np.array([0.3, 0.4]))
    assert clip_grad_norm_(a, 1.0).item() == pytest.approx(0.5)
    np.testing.assert_array_equal(a.grad.array, [0.3, 0.4])
    a.grad = hg.tensor([-3.0, 1.0])
    assert clip_grad_norm_(a, 1.0, norm_type="inf").item() == 3.0
    np.testing.assert_allclose(a.grad.array, [-3 / (3 + 1e-6), 1 / (3 + 1e-6)])
    a.grad = hg.tensor([-3.0, 2.0])
    clip_grad_value_(a, 2.5)
    np.testing.assert_array_equal(a.grad.array, [-2.5, 2.0])


def test_no_gradients_gives_zero_and_generators_work():
    p = hg.tensor(np.ones(3), requires_grad=True)
    total = clip_grad_norm_(iter([p]), 1.0)
    assert total.item() == 0.0 and p.grad is None
    model = nn.Linear(3, 2)
    model(hg.tensor(np.ones((4, 3), np.float32))).sum().backward()
    want = math.sqrt(sum(float((q.grad.array.astype(np.float64) ** 2).sum())
                         for q in model.parameters()))
    total = clip_grad_norm_(model.parameters(), 0.1)  # a generator
    assert total.item() == pytest.approx(want, rel=1e-6)
    assert get_total_norm([q.grad for q in model.parameters()]).item() == pytest.approx(0.1,
                                                                                       rel=1e-5)


def test_the_gradient_array_is_scaled_in_place():
    p = hg.tensor(np.zeros(2), requires_grad=True)
    p.grad = hg.tensor([3.0, 4.0])
    array = p.grad.array
    clip_grad_norm_([p], 1.0)
    assert p.grad.array is array and np.linalg.norm(array) == pytest.approx(1.0, rel=1e-5)


def test_sparse_gradient_norm_counts_repeated_rows_once_summed():
    p = hg.tensor(np.zeros((4, 2)), requires_grad=True)
    # row 1 twice: the gradient is its sum, [3, 4] -> norm 5 (not sqrt(1 + 4 + 4 + 16))
    p.grad = SparseCOOTensor(np.array([1, 1]), np.array([[1.0, 2.0], [2.0, 2.0]]), (4, 2))
    total = clip_grad_norm_([p], 1.0)
    assert total.item() == pytest.approx(5.0)
    np.testing.assert_allclose(p.grad.to_dense().array[1], [3 / (5 + 1e-6), 4 / (5 + 1e-6)])
    p.grad = SparseCOOTensor(np.array([0]), np.array([[-3.0, 1.0]]), (4, 2))
    clip_grad_value_([p], 2.0)
    np.testing.assert_array_equal(p.grad.to_dense().array[0], [-2.0, 1.0])


def test_errors():
    params = _params(3)
    params[1].grad.array[0] = np.nan
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    p = hg.tensor(np.zeros(0), requires_grad=True)
    p.grad = hg.tensor(np.zeros(0))
    with pytest.raises(RuntimeError, match="-inf norm on an empty tensor"):
        clip_grad_norm_([p], 1.0, norm_type=-math.inf)
    with pytest.raises(ValueError):
        clip_grad_norm_(params, 1.0, norm_type="two")


# --- under DDP -------------------------------------------------------------------------------
PER_RANK, IN, OUT = 4, 5, 3


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_under_ddp_clips_the_full_batch_gradient(group, norm_type):
    """Each rank backpropagates its shard through DDP (which averages the gradients), then
    clips: the total norm and clipped gradients equal a single-process full-batch run's."""
    from hpcgrad.nn.parallel import DistributedDataParallel as DDP

    rank, size = group.rank(), group.size()
    rng = np.random.default_rng(size)
    x = rng.standard_normal((size * PER_RANK, IN))
    y = rng.standard_normal((size * PER_RANK, OUT)) * 10  # large: the norm needs clipping

    def model():
        hg.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 4), nn.Tanh(), nn.Linear(4, OUT)).double()

    def loss(m, rows):
        return ((m(hg.tensor(x[rows])) - hg.tensor(y[rows])) ** 2).mean()

    ref = model()
    loss(ref, slice(None)).backward()
    want_total = clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    ddp = DDP(model(), process_group=group)
    loss(ddp, slice(rank * PER_RANK, (rank + 1) * PER_RANK)).backward()
    total = clip_grad_norm_(ddp.parameters(), 0.5, norm_type)
    assert want_total.item() > 0.5  # clipping happened
    np.testing.assert_allclose(total.item(), want_total.item(), rtol=1e-12)
    for p, q in zip(ddp.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad.array, q.grad.array, rtol=1e-11, atol=1e-14)
