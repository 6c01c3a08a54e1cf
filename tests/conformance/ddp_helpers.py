"""Helpers of the ports of PyTorch's DDP tests: models, a bounded group, data, steps, checks."""

import contextlib
import copy

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

# A test that fails on one rank leaves the others in a collective: they get a CommTimeoutError
# after this long instead of hanging until the run's MPIEXEC_TIMEOUT.
GROUP_TIMEOUT = 60

mpi2 = pytest.mark.mpi(min_size=2)  # PyTorch's DDP tests run at 2+ ranks (here: 2 and 3)

# PyTorch's error substrings (distributed_test.py), kept verbatim so the ports check the same text.
PREV_REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"
RECOMMEND_FIND_UNUSED = "passing the keyword argument `find_unused_parameters=True`"
FIND_UNUSED_ENABLED = "Since `find_unused_parameters=True` is enabled"
OUTPUTS_NOT_USED_IN_LOSS = "`forward` function outputs participate in calculating loss"




# --- arrays and comparisons ------------------------------------------------------------------
def arr(x):
    """The numpy array behind a Tensor (a sparse gradient densified), or the value as an array."""
    if x is None:
        return None
    if getattr(x, "is_sparse", False):
        return np.asarray(x.to_dense().array)
    if isinstance(x, hg.Tensor):
        return np.asarray(x.detach().array)
    return np.asarray(x)


def assert_close(actual, expected, rtol=1.3e-6, atol=1e-5, msg=""):
    """PyTorch's assertEqual for float32 tensors (rtol 1.3e-6, atol 1e-5); None only equals None."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{msg}: {actual!r} vs {expected!r}"
        return
    a, e = arr(actual), arr(expected)
    assert a.shape == e.shape, f"{msg}: shape {a.shape} vs {e.shape}"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=msg)


def assert_params_close(want, got, **tol):
    """The parameters of two models agree pairwise."""
    want, got = list(want), list(got)
    assert len(want) == len(got), f"{len(want)} parameters vs {len(got)}"
    for i, (w, g) in enumerate(zip(want, got)):
        assert_close(g, w, msg=f"parameter {i}", **tol)


def assert_grads_close(want, got, **tol):
    want, got = list(want), list(got)
    assert len(want) == len(got), f"{len(want)} parameters vs {len(got)}"
    for i, (w, g) in enumerate(zip(want, got)):
        assert_close(g.grad, w.grad, msg=f"gradient of parameter {i}", **tol)


def gather(group, x):
    """Every rank's copy of ``x`` (a Tensor or array), in rank order."""
    mine = np.ascontiguousarray(arr(x))
    out = [None] * group.size()
    dist.all_gather_object(out, mine, group=group)
    return out


def assert_same_on_all_ranks(group, tensors, what="tensor"):
    for i, t in enumerate(tensors):
        copies = gather(group, t)
        for r, c in enumerate(copies[1:], 1):
            np.testing.assert_array_equal(c, copies[0], err_msg=f"{what} {i}: rank {r} != rank 0")


def validate_net_equivalence(group, net):
    """PyTorch's validate_net_equivalence: every rank holds the same module parameters."""
    assert_same_on_all_ranks(group, list(net.module.parameters()), "parameter")


# --- data ---------------------------------------------------------------------------------
def rng(seed):
    """A generator seeded alike on every rank: PyTorch's tests seed torch the same everywhere."""
    return np.random.default_rng(seed)


def randn(gen, *shape, requires_grad=False):
    return hg.tensor(gen.standard_normal(shape).astype(np.float32), requires_grad=requires_grad)


def rand(gen, *shape, requires_grad=False):
    return hg.tensor(gen.random(shape).astype(np.float32), requires_grad=requires_grad)


def ones(*shape, scale=1.0):
    return hg.tensor(np.full(shape, scale, dtype=np.float32))


def rows(x, start, stop):
    """x[start:stop] as a new leaf (DDP's share of a batch)."""
    return hg.tensor(arr(x)[start:stop])


def permute_rows(x, gen):
    """x[torch.randperm(len(x))] with a generator seeded alike on every rank."""
    return hg.tensor(arr(x)[gen.permutation(len(arr(x)))])


# --- models (PyTorch's, same layers and shapes) ------------------------------------------------
def seeded(factory, seed=0):
    """``factory()`` built from a known seed: the same initial values on every rank."""
    hg.manual_seed(seed)
    return factory()


class _FC2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    """distributed_test.py's Net: a frozen bias and an integer parameter that needs no grad."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_param = nn.Parameter(hg.tensor(np.array([2, 2], dtype=np.int64)),
                                          requires_grad=False)

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


class SoftmaxNet(nn.Module):
    """2 -> 10 -> 4 without biases, ReLU, softmax: the model of several c10d DDP tests."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(x, dim=1)


class CommonNet(nn.Module):
    """test_c10d_common.py's Net: three bias-free layers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


class Task(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(hg.ones(2, 2))

    def forward(self, x):
        return self.p + x


class ModuleForDdpCommHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.t0 = Task()

    def forward(self, x, rank):
        return self.t0(x + rank)


class BatchNormNet(nn.Module):
    def __init__(self, affine=True):
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = hg.reshape(self.fc1(x), (-1, 4, 10))
        x = self.bn(x)
        x = hg.reshape(x, (-1, 40))
        return F.softmax(self.fc2(x), dim=1)


class TwoLinLayerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x)


class EmbeddingNetDifferentParams(nn.Module):
    """An embedding whose width, or the number of parameters, depends on the rank."""

    def __init__(self, rank, diff_num_params=False):
        super().__init__()
        embedding_dim = 500 if diff_num_params or rank == 0 else 50
        self.embedding = nn.Embedding(num_embeddings=10, embedding_dim=embedding_dim)
        self.lin = nn.Linear(embedding_dim, 1)
        if diff_num_params:
            self.lin2 = nn.Linear(1, 1, bias=False)

    def forward(self, x):
        return self.lin(self.embedding(x))


def is_all_ones(x, shape):
    """torch.equal(x, torch.ones(shape)): the input-dependent branch of the control-flow models."""
    a = arr(x)
    return a.shape == tuple(shape) and bool(np.all(a == 1))


class ControlFlowToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        # The second layer is used depending on the input.
        if is_all_ones(x, (20, 10)):
            return self.lin2(F.relu(self.lin1(x)))
        return F.relu(self.lin1(x))


class EmbeddingBagMean(nn.Module):
    """nn.EmbeddingBag(n, d, mode="mean", sparse=...) on a 2-D input: the mean of each row's bag
    (hpcgrad has no EmbeddingBag; the gradient is the same row-sparse one)."""

    def __init__(self, num_embeddings, embedding_dim, sparse=False):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, embedding_dim, sparse=sparse)

    def forward(self, idx):
        return self.embedding(idx).mean(1)


class SparseGradientModule(nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.embedding = EmbeddingBagMean(10, 10, sparse=sparse)

    def forward(self, x):
        return F.softmax(self.embedding(x), dim=1)


# --- training steps ---------------------------------------------------------------------------
def mse(output, target):
    return F.mse_loss(output, target)


def step(model, x, target, loss=mse, scale=1.0):
    """PyTorch's _test_DDP_helper: train mode, forward, loss * scale, backward."""
    model.train()
    out = loss(model(x), target)
    (out * scale if scale != 1.0 else out).backward()


def model_step(model, zero_grad=False):
    """PyTorch's _model_step(_with_zero_grad): param += grad, then drop (or zero) the grad."""
    for p in model.parameters():
        if p.grad is None:
            continue
        p.array += p.grad.array
        if zero_grad:
            p.grad.array[...] = 0
        else:
            p.grad = None


def clear_grad(t):
    """grad.requires_grad_(False); grad.zero_() of PyTorch's loops (keeps the same array)."""
    if t.grad is not None:
        t.grad.array[...] = 0


def ddp(module, group, **kwargs):
    return DDP(module, process_group=group, **kwargs)


def local_and_ddp(factory, group, seed=0, **kwargs):
    """A model and a DDP-wrapped deep copy of it, equal on every rank."""
    model = seeded(factory, seed)
    return model, ddp(copy.deepcopy(model), group, **kwargs)


@contextlib.contextmanager
def raises_on_every_rank(group, exc_type, match=None):
    """The block raises ``exc_type`` (matching ``match``) on this rank; afterwards every rank
    learns whether every rank raised, so one rank's miss fails all of them instead of hanging."""
    raised = False
    try:
        with pytest.raises(exc_type, match=match) as info:
            yield info
        raised = True
    finally:
        everyone = [None] * group.size()
        dist.all_gather_object(everyone, raised, group=group)
    assert all(everyone), f"ranks that did not raise {exc_type.__name__}: " \
                          f"{[r for r, ok in enumerate(everyone) if not ok]}"


def expected_no_grad_error(message, rank, unused_names):
    """The parts of PyTorch's unfinished-reduction error that the ports check (debug-mode text:
    hpcgrad always names the parameters, as PyTorch does with TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    for part in (PREV_REDUCTION_UNFINISHED, RECOMMEND_FIND_UNUSED, OUTPUTS_NOT_USED_IN_LOSS,
                 f"did not receive grad for rank {rank}: {', '.join(unused_names)}"):
        assert part in message, f"expected {part!r} in {message!r}"
    assert FIND_UNUSED_ENABLED not in message, message
