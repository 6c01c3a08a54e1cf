"""elastic.State with ZeroRedundancyOptimizer and SyncBatchNorm without a launcher (Note [ZeRO
under elastic.run] in hpcgrad/elastic/state.py): what it refuses, what a commit holds, and ZeRO
re-partitioned over another world equal to the unsharded optimizer. The lost rank itself:
test_zero_syncbn.py, under ULFM."""

import numpy as np
import pytest

import hpcgrad
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.distributed import elastic
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer
from hpcgrad.tensor import Tensor

mpi = pytest.mark.mpi(min_size=1)


@pytest.fixture
def default_group():
    """A default group for this test; one this test started is destroyed after it (the serial
    suite's later tests expect none)."""
    started = not dist.is_initialized()
    dist.init_process_group()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


def _model(sync_group=None):
    hpcgrad.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4, process_group=sync_group),
                         nn.Tanh(), nn.Linear(4, 2))


def _step(model, optimizer, step):
    rng = np.random.default_rng([5, step])
    x = Tensor(rng.standard_normal((8, 3)).astype(np.float32))
    optimizer.zero_grad()
    (model(x) ** 2).mean().backward()
    optimizer.step()


def _flat(tensors):
    return np.concatenate([np.asarray(t.detach().numpy()).ravel() for t in tensors])


def test_state_refuses_sync_batchnorm_over_an_explicit_group(default_group):
    group = dist.new_group([0])
    with pytest.raises(NotImplementedError,
                       match=r"SyncBatchNorm '1' has an explicit process_group.*"
                             r"process_group=None"):
        elastic.State(_model(group))
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(plain, process_group=group)
    with pytest.raises(NotImplementedError, match="SyncBatchNorm '1'"):
        elastic.State(converted)
    dist.destroy_process_group(group)


def test_state_refuses_zero_over_another_group(default_group):
    group = dist.new_group([0])
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), hpcgrad.optim.Adam, process_group=group,
                                   lr=0.01)
    with pytest.raises(NotImplementedError, match="group other than the default one"):
        elastic.State(model, zero)
    dist.destroy_process_group(group)


def test_commit_holds_sync_batchnorm_running_statistics():
    """A SyncBatchNorm over the default group is accepted; its running statistics (buffers)
    are in the commit and come back with restore."""
    model = _model()
    optimizer = hpcgrad.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.State(model, optimizer)
    _step(model, optimizer, 0)
    state.commit()
    saved = {name: t.numpy().copy() for name, t in model.state_dict().items()}
    _step(model, optimizer, 1)
    assert not np.array_equal(model[1].running_mean.numpy(), saved["1.running_mean"])
    state.restore()
    for name, t in model.state_dict().items():
        assert np.array_equal(t.numpy(), saved[name]), name
    assert int(model[1].num_batches_tracked.numpy()) == 1


@mpi
@pytest.mark.parametrize("bucket_view", [False, True])
def test_zero_commit_holds_the_whole_state_and_repartitions_over_another_world(world,
                                                                              bucket_view):
    """On every rank the commit holds what ``consolidate_state_dict`` gives rank 0; restored
    after re-partitioning over a one-rank world per rank, ZeRO steps on equal to the
    unsharded Adam loaded from the same state, bit for bit, and is the same object."""
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), hpcgrad.optim.Adam, lr=0.01,
                                   parameters_as_bucket_view=bucket_view)
    state = elastic.State(model, zero)
    for step in range(3):
        _step(model, zero, step)
    state.commit()
    whole = state._commits[-1][1]["optimizer"]
    assert sorted(whole["state"]) == list(range(6))  # every parameter's state, on every rank
    assert all(entry["step"] == 3 for entry in whole["state"].values())
    zero.consolidate_state_dict(to=0)
    if world.rank() == 0:
        consolidated = zero.state_dict()
        assert consolidated["param_groups"] == whole["param_groups"]
        for index, entry in consolidated["state"].items():
            for name, value in entry.items():
                assert np.array_equal(np.asarray(value), np.asarray(whole["state"][index][name]))
    committed_params = _flat(model.parameters())
    _step(model, zero, 3)  # undone by the restore
    alone = [dist.new_group([r]) for r in range(world.size())]
    mine = alone[world.rank()]
    zero._repartition(mine)
    state.restore()
    assert state.optimizer is zero and zero.world_size == 1
    assert len(zero.optim.state) == 6  # the whole state, alone
    ref_model = _model()
    ref_model.load_state_dict(model.state_dict())
    ref = hpcgrad.optim.Adam(ref_model.parameters(), lr=0.01)
    ref.load_state_dict(whole)
    assert np.array_equal(_flat(model.parameters()), committed_params)
    for step in range(3, 6):
        _step(model, zero, step)
        _step(ref_model, ref, step)
    assert np.array_equal(_flat(model.parameters()), _flat(ref_model.parameters()))
    for g in alone:
        dist.destroy_process_group(g)
