"""DDP with parameters on numpy and on cupy equals single-process full-batch training on the host.

tests/ddp/test_ddp.py's idea on each array module: every rank builds the MLP from its own seed
(DDP must broadcast rank 0's values), moves it to the module's device, and trains its shard of
each step's batch; the reference is the same MLP from rank 0's seed, trained in numpy on the
whole batch. Parameters agree up to float64 summation order.
"""

import numpy as np
import pytest
from arrays import xp_fixture  # noqa: F401  (the xp fixture)

import hpcgrad as hg
from hpcgrad import backend, nn
from hpcgrad.ddp import buckets
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

IN, HID, OUT = 5, 7, 3
PER_RANK = 4  # samples per rank and step
STEPS = 3  # buckets are rebuilt after the first step: later steps run on the rebuilt ones
LR = 0.1
# float64, values of order 1: DDP and the reference differ in summation order (per-rank means
# averaged vs one mean; cuBLAS vs numpy's BLAS), ~1e-15.
TOL = 1e-10

pytestmark = pytest.mark.mpi(min_size=1)



class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.mid = nn.Linear(HID, HID)
        self.out = nn.Linear(HID, OUT)

    def forward(self, x):
        return self.out(self.mid(self.inp(x).tanh()).tanh())


def make_mlp(seed):
    hg.manual_seed(seed)
    return MLP().double()


def batch(step, size):
    """One step's whole batch (every rank's shard), the same on every rank."""
    rng = np.random.default_rng([step, size, 7])
    n = size * PER_RANK
    return rng.standard_normal((n, IN)), rng.standard_normal((n, OUT))


def mse(out, y):
    return ((out - y) ** 2).mean()


def sgd(model):
    for p in model.parameters():
        p.array -= LR * p.grad.array


CASES = {
    "default": ({}, False),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, False),
    "several_buckets": ({}, True),
    "several_buckets_as_view": ({"gradient_as_bucket_view": True}, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_full_batch_training(xp, group, monkeypatch, case):
    options, several = CASES[case]
    options = dict(options)
    if several:  # 6 float64 parameters in buckets of about 128 bytes: 3 or more buckets
        monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 128)
        options["bucket_cap_mb"] = 256 / 2 ** 20
    rank, size = group.rank(), group.size()
    model = make_mlp(seed=rank).to(xp.device)
    ref = make_mlp(seed=0)
    ddp = DDP(model, process_group=group, **options)
    if several:
        assert len(ddp.reducer.buckets) >= 3, ddp.reducer.bucket_indices()
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in params.items():
        assert backend.device_of(p.array) == xp.device, f"{name} left {xp.device}"
        np.testing.assert_array_equal(xp.numpy(p), ref_params[name].array,
                                      err_msg=f"{name} is not rank 0's initial value")

    for step in range(STEPS):
        x, y = batch(step, size)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        mse(ddp(xp.tensor(x[mine])), xp.tensor(y[mine])).backward()
        mse(ref(hg.tensor(x)), hg.tensor(y)).backward()
        for name, p in params.items():
            assert backend.device_of(p.grad.array) == xp.device, f"{name}.grad left {xp.device}"
            np.testing.assert_allclose(xp.numpy(p.grad), ref_params[name].grad.array, rtol=0,
                                       atol=TOL, err_msg=f"{name}.grad at step {step}")
        sgd(model)
        sgd(ref)
        for p in model.parameters():  # as a bucket view, .grad must stay the view: zero in place
            if options.get("gradient_as_bucket_view"):
                p.grad.array[...] = 0
            else:
                p.grad = None
        ref.zero_grad()

    host = {name: xp.numpy(p) for name, p in params.items()}
    for name, value in host.items():
        np.testing.assert_allclose(value, ref_params[name].array, rtol=0, atol=TOL,
                                   err_msg=f"{name} after {STEPS} steps")
    everyone = group.comm.allgather(host)
    for r, theirs in enumerate(everyone):
        for name, value in theirs.items():
            assert np.array_equal(value, host[name]), f"{name} differs between rank {r} and {rank}"


VOCAB = 11


class Bag(nn.Module):
    """Embedding rows and dense rows summed: with small buckets the embedding's sparse bucket sits
    between dense ones (Note [Sparse gathers in the group's order])."""

    def __init__(self, sparse):
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.emb = nn.Embedding(VOCAB, HID, sparse=sparse)
        self.out = nn.Linear(HID, OUT)

    def forward(self, x, idx):
        return self.out((self.inp(x) + self.emb(idx)).tanh())


def test_sparse_embedding_matches_full_batch_training(xp, group, monkeypatch):
    """A sparse gradient's rows gathered from every rank (on a GPU: device arrays, staged or
    not) sum to the full batch's dense embedding gradient; the dense buckets around it agree."""
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 128)
    rank, size = group.rank(), group.size()
    hg.manual_seed(rank)
    model = Bag(sparse=True).double().to(xp.device)
    hg.manual_seed(0)
    ref = Bag(sparse=False).double()
    ddp = DDP(model, process_group=group, bucket_cap_mb=256 / 2 ** 20)
    assert [b.expect_sparse for b in ddp.reducer.buckets].count(True) == 1
    assert len(ddp.reducer.buckets) >= 3, ddp.reducer.bucket_indices()
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for step in range(STEPS):
        x, _ = batch(step, size)
        rng = np.random.default_rng([step, size, 11])
        idx = rng.integers(0, VOCAB, len(x))
        y = rng.standard_normal((len(x), OUT))
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        mse(ddp(xp.tensor(x[mine]), xp.tensor(idx[mine])), xp.tensor(y[mine])).backward()
        mse(ref(hg.tensor(x), hg.tensor(idx)), hg.tensor(y)).backward()
        for name, p in params.items():
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            assert p.grad.is_sparse == (name == "emb.weight"), name
            assert backend.device_of(grad.array) == xp.device, f"{name}.grad left {xp.device}"
            np.testing.assert_allclose(xp.numpy(grad), ref_params[name].grad.array, rtol=0,
                                       atol=TOL, err_msg=f"{name}.grad at step {step}")
        for name, p in params.items():
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            p.array -= LR * grad.array
            p.grad = None
        sgd(ref)
        ref.zero_grad()
