"""Join with ZeroRedundancyOptimizer on uneven inputs, against the unsharded optimizer in one process.

Rank r has 2 + r iterations. The reference, run on every rank first, steps the unsharded
optimizer over a copy of the model; its gradient at iteration t is the average, over the world
size, of the gradients of the ranks still active at t (a joined rank contributes zero), taken at
the reference's parameters. As PyTorch's test_zero_join: ZeRO's join hook needs the gradients
set before it steps, so a first joinable of the test's sets them on a joined rank (an active
rank sets them itself), and ZeRO's hook then steps the joined rank's shard and takes part in the
broadcasts. Every rank's parameters must equal the reference's after every step (bit for bit:
each parameter is updated by the same arithmetic on its owner, then copied).
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import nn
from hpcgrad.distributed.algorithms.join import Join, Joinable, JoinHook
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.tensor import Tensor

IN, HID, OUT, ROWS = 4, 6, 3, 5
OPTIMIZERS = {"sgd_momentum": (hg.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adam": (hg.optim.Adam, {"lr": 0.01})}


def make_model():
    hg.manual_seed(4)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT)).double()


def shard(t, rank):
    rng = np.random.default_rng([31, t, rank])
    return rng.standard_normal((ROWS, IN)), rng.standard_normal((ROWS, OUT))


def reference_run(cls, options, counts):
    """[(gradients, parameters after the step)] of every iteration, one process."""
    ref = make_model()
    opt = cls(ref.parameters(), **options)
    size, out = len(counts), []
    for t in range(max(counts)):
        opt.zero_grad()
        loss = 0.0
        for r in range(size):
            if t < counts[r]:
                x, y = shard(t, r)
                loss = loss + ((ref(Tensor(x)) - Tensor(y)) ** 2).mean() * (1 / size)
        loss.backward()
        grads = [p.grad.array.copy() for p in ref.parameters()]
        opt.step()
        out.append((grads, [p.array.copy() for p in ref.parameters()]))
    return out


class GradientSetter(Joinable):
    """Sets the reference's gradient of each iteration; on a joined rank through its hook."""

    def __init__(self, params, trajectory, group):
        super().__init__()
        self.params, self.trajectory, self.group, self.t = params, trajectory, group, 0

    def set_next(self):
        for p, g in zip(self.params, self.trajectory[self.t][0]):
            p.grad = Tensor(g.copy())
        self.t += 1

    def join_hook(self, **kwargs):
        setter = self

        class Hook(JoinHook):
            def main_hook(self):
                setter.set_next()
        return Hook()

    @property
    def join_device(self):
        return self.params[0].device

    @property
    def join_process_group(self):
        return self.group


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_zero_join_hook_with_uneven_inputs(group, which):
    cls, options = OPTIMIZERS[which]
    rank, size = group.rank(), group.size()
    counts = [2 + r for r in range(size)]
    trajectory = reference_run(cls, options, counts)
    model = make_model()
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, cls, process_group=group, **options)
    setter = GradientSetter(params, trajectory, group)
    with Join([setter, zero]):
        for t in range(counts[rank]):
            Join.notify_join_context(setter)
            setter.set_next()
            zero.step()
            for p, want in zip(params, trajectory[t][1]):
                np.testing.assert_array_equal(p.array, want, err_msg=f"step {t}")
    assert setter.t == max(counts)  # the joined rank stepped the others' remaining iterations
    for p, want in zip(params, trajectory[-1][1]):
        np.testing.assert_array_equal(p.array, want)


@pytest.mark.mpi(min_size=2)
def test_zero_alone_in_join(group):
    """ZeRO as the first joinable: its step() carries the count. A joined rank with no
    gradients steps nothing of its shard (as the unsharded optimizer would skip those
    parameters) and still takes part in every broadcast: nobody hangs, all ranks agree."""
    rank, size = group.rank(), group.size()
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), hg.optim.SGD, process_group=group, lr=0.1)
    with Join([zero]):
        for t in range(1 + rank):
            zero.zero_grad()
            x, y = shard(t, rank)
            ((model(Tensor(x)) - Tensor(y)) ** 2).mean().backward()
            zero.step()
        zero.zero_grad()  # the joined rank's step inside Join sees no gradients
    everyone = group.comm.allgather([p.array for p in model.parameters()])
    for theirs in everyone:
        for a, b in zip(theirs, everyone[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_join_ddp_and_zero_do_not_hang(group):
    """Join([ddp, zero]): a joined rank shadows DDP's all-reduces, then ZeRO's broadcasts, in
    the active ranks' order; at the end every rank holds the same model."""
    rank = group.rank()
    model = make_model()
    ddp = DDP(model, process_group=group)
    zero = ZeroRedundancyOptimizer(model.parameters(), hg.optim.Adam, process_group=group, lr=0.01)
    with Join([ddp, zero]):
        for t in range(2 + rank):
            zero.zero_grad()
            x, y = shard(t, rank)
            ((ddp(Tensor(x)) - Tensor(y)) ** 2).mean().backward()
            zero.step()
    everyone = group.comm.allgather([p.array for p in model.parameters()])
    for theirs in everyone:
        for a, b in zip(theirs, everyone[0]):
            np.testing.assert_array_equal(a, b)


def test_join_argument_errors():
    model = make_model()
    with pytest.raises(ValueError, match="requires at least one joinable"):
        Join([])
    with pytest.raises(TypeError, match="Join expects Joinable objects"):
        Join([model])

    class Two(GradientSetter):
        pass
    a = GradientSetter(list(model.parameters()), [], group=object())
    b = Two(list(model.parameters()), [], group=object())
    with pytest.raises(ValueError, match="multiple process groups"):
        Join([a, b])
