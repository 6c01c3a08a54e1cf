"""DistributedDataParallel._set_params_and_buffers_to_ignore_for_model: ignored names stay local.

Each rank initialises the model from its own seed. DDP must bring every rank rank 0's values of
the parameters and buffers it syncs, and leave the ignored ones alone; after backward a synced
parameter's gradient is the average over ranks of each rank's local gradient, an ignored one's
is this rank's own. Every rank simulates every rank's training from the seeds, in one process.
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import nn
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

IN, HID, OUT, PER_RANK, STEPS, LR = 3, 4, 2, 5, 3, 0.1
IGNORED = ["b.weight", "b.bias", "own"]


class Two(nn.Module):
    """``a`` is synced, ``b`` ignored; buffer ``shared`` synced, ``own`` ignored (its shape
    differs between ranks: ignored entries are not compared either)."""

    def __init__(self, seed, own_size):
        super().__init__()
        hg.manual_seed(seed)
        self.a = nn.Linear(IN, HID).double()
        self.b = nn.Linear(HID, OUT).double()
        self.register_buffer("shared", hg.tensor(np.full(2, float(seed))))
        self.register_buffer("own", hg.tensor(np.full(own_size, float(seed))))

    def forward(self, x):
        return self.b(self.a(x).tanh())


def shard(step, rank):
    rng = np.random.default_rng([21, step, rank])
    return rng.standard_normal((PER_RANK, IN)), rng.standard_normal((PER_RANK, OUT))


def loss(model, x, y):
    return ((model(hg.tensor(x)) - hg.tensor(y)) ** 2).mean()


def grads_of(model, x, y):
    for p in model.parameters():
        p.grad = None
    loss(model, x, y).backward()
    return {n: p.grad.array.copy() for n, p in model.named_parameters()}


@pytest.mark.mpi(min_size=2)
def test_ignored_parameters_and_buffers_stay_local(group):
    """A reference per rank r, simulated on every rank: ``a`` starts from rank 0's values and
    steps with the average of the ranks' gradients, rank r's ``b`` from its own seed with its
    own gradient only."""
    rank, size = group.rank(), group.size()
    model = Two(seed=rank, own_size=1 + rank)
    DDP._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    assert model._ddp_params_and_buffers_to_ignore == IGNORED
    ddp = DDP(model, process_group=group)  # own's shapes differ: not a model mismatch
    assert ddp.reducer.names == ["a.weight", "a.bias"]

    sims = [Two(seed=r, own_size=1 + r) for r in range(size)]
    for sim in sims[1:]:  # DDP's broadcast of a and shared, from rank 0
        for p, q in zip(sim.a.parameters(), sims[0].a.parameters()):
            p.array[...] = q.array
    mine = dict(model.named_parameters())
    np.testing.assert_array_equal(model.shared.array, [0.0, 0.0])
    model.own.array[...] = 10.0 + rank  # not sent before forward either
    for step in range(STEPS):
        for name, p in dict(sims[rank].named_parameters()).items():
            np.testing.assert_allclose(mine[name].array, p.array, rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name} before step {step}")
        for p in model.parameters():
            p.grad = None
        loss(ddp, *shard(step, rank)).backward()
        each = [grads_of(sims[r], *shard(step, r)) for r in range(size)]
        want = {n: sum(g[n] for g in each) / size for n in ("a.weight", "a.bias")}
        want.update({n: each[rank][n] for n in ("b.weight", "b.bias")})
        for name, grad in want.items():
            np.testing.assert_allclose(mine[name].grad.array, grad, rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name}.grad at step {step}")
        for p in model.parameters():
            p.array -= LR * p.grad.array
        for r, sim in enumerate(sims):
            for name, p in sim.named_parameters():
                p.array -= LR * (want[name] if name.startswith("a.") else each[r][name])
    np.testing.assert_array_equal(model.own.array, np.full(1 + rank, 10.0 + rank))
    np.testing.assert_array_equal(model.shared.array, [0.0, 0.0])


@pytest.mark.mpi(min_size=2)
def test_every_trainable_parameter_ignored(group):
    model = Two(seed=0, own_size=1)
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, _ in model.named_parameters()])
    with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed"):
        DDP(model, process_group=group)


def test_names_must_be_a_list():
    with pytest.raises(TypeError, match="wrap it in a list"):
        DDP._set_params_and_buffers_to_ignore_for_model(Two(0, 1), "b.weight")
