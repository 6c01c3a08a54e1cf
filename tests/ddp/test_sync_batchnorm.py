"""SyncBatchNorm against BatchNorm over the whole (concatenated) batch in one process.

Each rank normalises its own rows with SyncBatchNorm; the reference, on every rank, runs
hpcgrad.nn.BatchNorm over every rank's rows at once (float64). Outputs, input gradients, the
summed weight/bias gradients and the running statistics must agree, with equal and unequal
per-rank batches (an empty one too), for (N, C), (N, C, L) and (N, C, H, W) inputs; under DDP
the parameters after SGD steps equal the single-process full-batch run.
"""

import subprocess
import sys

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.ddp import sync_batchnorm as sync_module
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.tensor import Tensor

mpi = pytest.mark.mpi(min_size=1)
C = 3
TOL = 1e-12  # float64; only the order of summation differs from the reference


def sizes_equal(n):
    return [4] * n


def sizes_unequal(n):
    """Different per-rank batches; at 3+ ranks one rank has none (it still joins the
    collectives)."""
    return [2 + 3 * r if not (n >= 3 and r == 1) else 0 for r in range(n)]


def sizes_last_empty(n):
    """The last rank has an empty batch (N=0), at any size: it joins the statistics' all_gather
    with count 0 and backward's all_reduce with zero sums, as PyTorch's empty-input branch."""
    return [3 + r for r in range(n - 1)] + [0]


def rank_rows(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def full_batch(sizes, tail, step):
    rng = np.random.default_rng([7, step, len(sizes)])
    x = 3.0 + 2.0 * rng.standard_normal((sum(sizes), C) + tail)  # a mean far from 0
    w = rng.standard_normal((sum(sizes), C) + tail)  # the loss is sum(y * w)
    return x, w


def make_layers(batchnorm_cls, group, momentum=0.1, affine=True):
    """(SyncBatchNorm, BatchNorm) with the same random weight and bias."""
    sync = nn.SyncBatchNorm(C, momentum=momentum, affine=affine, process_group=group).double()
    ref = batchnorm_cls(C, momentum=momentum, affine=affine).double()
    if affine:
        rng = np.random.default_rng(3)
        for layer in (sync, ref):
            layer.weight.array[...] = rng.standard_normal(C) + 1
            layer.bias.array[...] = np.arange(C) - 1.0
            rng = np.random.default_rng(3)
    return sync, ref


def summed(group, array):
    out = np.array(array, copy=True)
    dist.all_reduce(out, group=group)
    return out


def check_against_full_batch(group, batchnorm_cls, tail, sizes, momentum=0.1, affine=True,
                             steps=2):
    me = group.rank()
    sync, ref = make_layers(batchnorm_cls, group, momentum, affine)
    mine = rank_rows(sizes, me)
    for step in range(steps):
        x, w = full_batch(sizes, tail, step)
        xs = Tensor(x[mine].copy(), requires_grad=True)
        y = sync(xs)
        (y * Tensor(w[mine])).sum().backward()
        xr = Tensor(x, requires_grad=True)
        yr = ref(xr)
        (yr * Tensor(w)).sum().backward()

        np.testing.assert_allclose(y.array, yr.array[mine], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(xs.grad.array, xr.grad.array[mine], rtol=1e-10, atol=1e-10)
        if affine:
            for name in ("weight", "bias"):
                got = summed(group, getattr(sync, name).grad.array)
                np.testing.assert_allclose(got, getattr(ref, name).grad.array, rtol=1e-10,
                                           atol=1e-10, err_msg=name)
                getattr(sync, name).grad = getattr(ref, name).grad = None
    np.testing.assert_allclose(sync.running_mean.array, ref.running_mean.array, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(sync.running_var.array, ref.running_var.array, rtol=TOL, atol=TOL)
    assert int(sync.num_batches_tracked.array) == int(ref.num_batches_tracked.array) == steps
    # Eval uses the running statistics, as BatchNorm's.
    sync.eval(), ref.eval()
    x, _ = full_batch(sizes, tail, 99)
    np.testing.assert_allclose(sync(Tensor(x[mine])).array, ref(Tensor(x)).array[mine],
                               rtol=TOL, atol=TOL)


SHAPES = {"1d_NC": (nn.BatchNorm1d, ()), "1d_NCL": (nn.BatchNorm1d, (5,)),
          "2d": (nn.BatchNorm2d, (2, 3))}


@mpi
@pytest.mark.parametrize("sizes", [sizes_equal, sizes_unequal])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_equals_batchnorm_on_the_full_batch(group, shape, sizes):
    batchnorm_cls, tail = SHAPES[shape]
    check_against_full_batch(group, batchnorm_cls, tail, sizes(group.size()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_an_empty_batch_on_one_rank(group, shape):
    """Issue 25: the last rank's batch is empty (N=0). It returns an empty output and an empty
    input gradient, and its collectives (count 0, zero sums) give every rank the statistics of
    the concatenated batch of the others."""
    batchnorm_cls, tail = SHAPES[shape]
    check_against_full_batch(group, batchnorm_cls, tail, sizes_last_empty(group.size()))


@mpi
@pytest.mark.parametrize("momentum", [None, 0.5])
def test_momentum_and_no_affine(group, momentum):
    """momentum=None: the cumulative average over the steps; affine=False: no parameters."""
    check_against_full_batch(group, nn.BatchNorm1d, (2,), sizes_unequal(group.size()),
                             momentum=momentum, affine=False, steps=3)


@mpi
def test_float32_with_a_large_mean(group):
    """Mean 1e4, spread 1, float32: E[x^2] - E[x]^2 would lose every digit of the variance
    (float32 spacing at 1e8 is 8); the per-rank centred sums keep float32 accuracy."""
    sizes = sizes_unequal(group.size())
    mine = rank_rows(sizes, group.rank())
    rng = np.random.default_rng(5)
    x = 1e4 + rng.standard_normal((sum(sizes), C, 4))
    sync = nn.SyncBatchNorm(C, process_group=group)  # float32
    y = sync(Tensor(x[mine].astype(np.float32)))
    assert y.dtype == np.float32
    ref = nn.BatchNorm1d(C).double()
    want = ref(Tensor(x)).array[mine]
    np.testing.assert_allclose(y.array, want, rtol=0, atol=2e-3)
    np.testing.assert_allclose(sync.running_var.array, ref.running_var.array, rtol=1e-3)


@mpi
def test_eval_does_not_communicate(group, monkeypatch):
    sync = nn.SyncBatchNorm(C, process_group=group).double().eval()
    monkeypatch.setattr(sync_module, "sync_batch_norm", _refuse)
    x = np.random.default_rng(group.rank()).standard_normal((4, C))
    np.testing.assert_allclose(sync(Tensor(x)).array, x / np.sqrt(1 + sync.eps), rtol=TOL)


def _refuse(*args, **kwargs):
    raise AssertionError("communicated in a case that must not")


def test_one_rank_or_no_group_is_plain_batch_norm(monkeypatch):
    """Not initialised (or a group of 1): no collective, BatchNorm's math (PyTorch's fallback)."""
    monkeypatch.setattr(sync_module, "sync_batch_norm", _refuse)
    single = dist.new_group([0]) if dist.is_initialized() else None
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    sync = nn.SyncBatchNorm(C, process_group=single).double()
    ref = nn.BatchNorm1d(C).double()
    x = np.random.default_rng(1).standard_normal((5, C, 2))
    np.testing.assert_allclose(sync(Tensor(x)).array, ref(Tensor(x)).array, rtol=TOL)
    np.testing.assert_allclose(sync.running_var.array, ref.running_var.array, rtol=TOL)


@mpi
def test_subgroup(group):
    """process_group = world ranks {0, last}: statistics over those ranks' batches only."""
    members = sorted({0, dist.get_world_size() - 1})
    sub = dist.new_group(members)
    try:
        if dist.get_rank() in members:
            check_against_full_batch(sub, nn.BatchNorm2d, (2, 2), sizes_unequal(sub.size()))
    finally:
        dist.destroy_process_group(sub)


# --- DDP --------------------------------------------------------------------------------------
PER_RANK, IN, HID, OUT, STEPS, LR = 4, 4, 5, 2, 3, 0.1


class Net(nn.Module):
    """``pre`` normalises the data itself: its input needs no gradient, so its backward skips
    the all_reduce (its weight and bias gradients are local ones, reduced by DDP)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.BatchNorm1d(IN)
        self.fc = nn.Linear(IN, HID)
        self.bn = nn.BatchNorm1d(HID)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(HID, OUT), nn.BatchNorm1d(OUT))

    def forward(self, x):
        return self.head(self.bn(self.fc(self.pre(x))))


def ddp_batch(step, n):
    rng = np.random.default_rng([11, step, n])
    return rng.standard_normal((n * PER_RANK, IN)), rng.standard_normal((n * PER_RANK, OUT))


@mpi
def test_ddp_training_equals_full_batch(group):
    """DDP averages each rank's mean loss: the full batch's mean loss when shards are equal."""
    me, n = group.rank(), group.size()
    hg.manual_seed(5)
    ref = Net().double()
    hg.manual_seed(5)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net().double(), group)
    ddp = DDP(model, process_group=group)
    sgd = hg.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    ref_sgd = hg.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
    for step in range(STEPS):
        x, y = ddp_batch(step, n)
        sgd.zero_grad()
        ((ddp(Tensor(x[mine])) - Tensor(y[mine])) ** 2).mean().backward()
        sgd.step()
        ref_sgd.zero_grad()
        ((ref(Tensor(x)) - Tensor(y)) ** 2).mean().backward()
        ref_sgd.step()
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, param in want.items():
        np.testing.assert_allclose(got[name].array, param.array, rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    for name, buf in ref.named_buffers():
        np.testing.assert_allclose(dict(model.named_buffers())[name].array, buf.array, rtol=1e-12,
                                   atol=1e-12, err_msg=name)


class ConvNet(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU -> Linear: the empty rank's backward runs through all of them."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc = nn.Linear(C * 9, OUT)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).relu().reshape(x.shape[0], C * 9))


@pytest.mark.mpi(min_size=2)
def test_ddp_with_an_empty_batch_on_one_rank(group):
    """Issue 25: under DDP the last rank has N=0 in every step. It takes part in SyncBatchNorm's
    collectives and DDP's reduction (with zero gradients), so nobody waits for the timeout and
    the parameters and running statistics equal the single-process run on the concatenated
    batch. Each rank's loss is its sum of squares times size / total rows: DDP's average of
    them is the full batch's sum over total rows (a mean would be NaN on the empty rank)."""
    me, n = group.rank(), group.size()
    sizes = sizes_last_empty(n)
    total, mine = sum(sizes), rank_rows(sizes, me)
    hg.manual_seed(9)
    ref = ConvNet().double()
    hg.manual_seed(9)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(ConvNet().double(), group)
    ddp = DDP(model, process_group=group)
    sgd = hg.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    ref_sgd = hg.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        rng = np.random.default_rng([13, step])
        x, y = rng.standard_normal((total, 2, 3, 3)), rng.standard_normal((total, OUT))
        sgd.zero_grad()
        out = ddp(Tensor(x[mine].copy()))
        assert out.shape == (sizes[me], OUT)
        (((out - Tensor(y[mine])) ** 2).sum() * (n / total)).backward()
        sgd.step()
        ref_sgd.zero_grad()
        (((ref(Tensor(x)) - Tensor(y)) ** 2).sum() * (1 / total)).backward()
        ref_sgd.step()
    for name, param in ref.named_parameters():
        np.testing.assert_allclose(dict(model.named_parameters())[name].array, param.array,
                                   rtol=1e-10, atol=1e-12, err_msg=name)
    for name, buf in ref.named_buffers():
        np.testing.assert_allclose(dict(model.named_buffers())[name].array, buf.array, rtol=1e-12,
                                   atol=1e-12, err_msg=name)


# --- convert_sync_batchnorm -------------------------------------------------------------------
def test_convert_sync_batchnorm_keeps_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.3),
                          nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, eps=1e-3, affine=False)))
    model[1].running_mean.array[...] = 0.5
    model[2][1].eval()
    old = [model[1], model[2][1]]
    group = object()  # stored as given, used only when training with several ranks
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model and isinstance(model[0], nn.Linear)
    new = [model[1], model[2][1]]
    for before, after in zip(old, new):
        assert type(after) is nn.SyncBatchNorm and after.process_group is group
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats",
                     "training"):
            assert getattr(after, attr) == getattr(before, attr), attr
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(after, name) is getattr(before, name), name
    assert new[0].weight is not None and new[1].weight is None
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight",
                                                        "1.bias", "2.0.weight", "2.0.bias"]
    root = nn.BatchNorm2d(2)
    assert isinstance(nn.SyncBatchNorm.convert_sync_batchnorm(root), nn.SyncBatchNorm)


def test_importing_nn_does_not_import_distributed():
    code = ("import sys, hpcgrad.nn; assert 'hpcgrad.distributed' not in sys.modules; "
            "hpcgrad.nn.SyncBatchNorm; assert 'hpcgrad.ddp.sync_batchnorm' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- errors -----------------------------------------------------------------------------------
def test_input_rank_and_channels_are_checked():
    layer = nn.SyncBatchNorm(C)
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        layer(Tensor(np.zeros(C)))
    with pytest.raises(ValueError, match=r"expected 3 channels on dim 1"):
        layer(Tensor(np.zeros((4, 2))))


def test_one_value_per_channel_when_training_one_rank():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        nn.SyncBatchNorm(C)(Tensor(np.zeros((1, C))))


@pytest.mark.mpi(min_size=2)
def test_one_value_per_channel_over_the_group(group):
    """One sample in the whole group: every rank raises (after the statistics' all_gather)."""
    rows = 1 if group.rank() == 0 else 0
    with pytest.raises(ValueError, match="Expected more than 1 value per channel.*1 over the "
                                         "group's"):
        nn.SyncBatchNorm(C, process_group=group).double()(Tensor(np.zeros((rows, C))))
    # One per rank is enough with 2+ ranks, as in PyTorch.
    out = nn.SyncBatchNorm(C, process_group=group).double()(Tensor(np.full((1, C), float(group.rank()))))
    assert out.shape == (1, C)


@pytest.mark.mpi(min_size=2)
def test_integer_input_is_refused(group):
    with pytest.raises(TypeError, match="expected a floating-point input, got int64"):
        nn.SyncBatchNorm(C, process_group=group)(Tensor(np.zeros((2, C), np.int64)))


@pytest.mark.mpi(min_size=2)
def test_double_backward_is_refused_with_a_reason(group):
    x = Tensor(np.random.default_rng(group.rank()).standard_normal((3, C)), requires_grad=True)
    y = nn.SyncBatchNorm(C, process_group=group).double()(x)
    with pytest.raises(NotImplementedError, match="double backward"):
        hg.autograd.grad((y * y).sum(), x, create_graph=True)
