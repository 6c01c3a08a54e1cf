"""hpcgrad.distributed.elastic on one rank: State's commits, ElasticSampler's re-sharding, the
commit agreement's mask, and run without fault tolerance (any MPI, no launcher)."""

import warnings

import numpy as np
import pytest

import hpcgrad
from hpcgrad import nn
from hpcgrad.data import DistributedSampler
from hpcgrad.distributed import elastic
from hpcgrad.elastic import world


@pytest.fixture
def default_group():
    """run initializes the default group; the serial suite's later tests expect none, so a
    group this test started is destroyed after it."""
    import hpcgrad.distributed as dist
    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


def _model():
    hpcgrad.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _params(model):
    return np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


def _train_step(model, optimizer):
    x = hpcgrad.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3))
    loss = (model(x) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_restore_puts_back_model_optimizer_sampler_counters_and_objects():
    model = _model()
    optimizer = hpcgrad.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = elastic.ElasticSampler(list(range(10)), 2, 0)
    state = elastic.State(model, optimizer, sampler=sampler, best=[1.0])
    _train_step(model, optimizer)
    sampler.record_batch(2)
    state.step, state.epoch = 1, 0
    state.commit()
    saved = _params(model)
    _train_step(model, optimizer)  # what the restore must undo, momentum buffers included
    sampler.record_batch(2)
    state.step, state.best[0] = 2, 0.5
    state.commit()
    _train_step(model, optimizer)
    state.restore(state.commits()[0])
    assert np.array_equal(_params(model), saved)
    assert (state.step, state.best, sampler.processed) == (1, [1.0], 4)
    assert all(p.grad is None for p in model.parameters())
    assert state.commits() == [1]  # the undone commit is gone
    # the same next step from the same state gives the same parameters
    _train_step(model, optimizer)
    again = _params(model)
    state.restore()
    _train_step(model, optimizer)
    assert np.array_equal(_params(model), again)


def test_restore_without_a_commit_says_what_to_do():
    state = elastic.State(_model())
    with pytest.raises(RuntimeError, match="nothing committed yet"):
        state.restore()


def test_state_refuses_ddp():
    """ZeRO and SyncBatchNorm over the default group are accepted: test_state_zero.py."""
    from hpcgrad.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # the type is what counts
    with pytest.raises(TypeError, match="takes the plain module"):
        elastic.State(ddp)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_sampler_rest_of_epoch_is_dealt_over_any_world(size):
    data = list(range(23))
    first = [elastic.ElasticSampler(data, 4, r, seed=5) for r in range(4)]
    order = first[0].permutation()
    for s in first:
        s.record_batch(2)  # 4 ranks x 2 samples consumed
    rest = [list(s) for s in first]
    assert sorted(sum(rest, [])) == sorted(order[8:].tolist() + order[:1].tolist())
    for s in first:
        s.reshard(size, min(s.rank, size - 1))
    shards = [list(elastic.ElasticSampler(data, size, r, seed=5)) for r in range(size)]
    moved = []
    for r in range(size):
        s = elastic.ElasticSampler(data, 4, 0, seed=5)
        s.load_state_dict({"epoch": 0, "processed": 8})
        s.reshard(size, r)
        moved.append(list(s))
    covered = sum(moved, [])
    pad = -(-15 // size) * size - 15  # padded to a multiple of the world ...
    assert sorted(covered) == sorted(order[8:].tolist() + order[:pad].tolist())  # ... from its start
    assert max(map(len, moved)) == min(map(len, moved)) == len(moved[0])
    assert all(len(shard) == -(-23 // size) for shard in shards)


@pytest.mark.parametrize("size,batch,steps", [(4, 2, 2), (3, 5, 1), (2, 3, 3), (5, 1, 4)])
def test_sampler_at_one_world_size_is_distributed_sampler(size, batch, steps):
    """Never re-dealt over another size, the rest of the epoch (padding included) is what
    DistributedSampler's shard has left: an elastic run without failures, or resumed at the
    same size, is a plain DDP run."""
    data = list(range(23))
    for epoch in (0, 3):
        for rank in range(size):
            plain = DistributedSampler(data, size, rank, seed=5)
            plain.set_epoch(epoch)
            s = elastic.ElasticSampler(data, size, rank, seed=5)
            s.set_epoch(epoch)
            assert list(s) == list(plain)
            s.load_state_dict({"epoch": epoch, "processed": steps * batch * size})  # resumed
            assert list(s) == list(plain)[steps * batch:]


def test_sampler_new_epoch_starts_over_and_same_epoch_keeps_its_place():
    s = elastic.ElasticSampler(list(range(8)), 2, 0)
    s.record_batch(1)
    s.set_epoch(0)
    assert s.processed == 2
    s.set_epoch(1)
    assert (s.epoch, s.processed) == (1, 0)
    with pytest.raises(ValueError, match="Invalid rank 2"):
        s.reshard(2, 2)


def test_agreement_mask_picks_the_newest_commit_every_survivor_holds():
    # rank A holds commits 7 and 8, rank B only got to 6 and 7: AND keeps 7's bit
    mask_a, mask_b = world._mask([7, 8]), world._mask([6, 7])
    common = mask_a & mask_b
    held = [s for s in [7, 8] if common & (1 << (s % world._BITS))]
    assert max(held) == 7
    assert world._mask([29, 30]) == (1 << 29) | 1  # serials wrap around the 30 bits


def test_run_without_fault_tolerance_runs_once_and_says_a_loss_ends_the_job(monkeypatch,
                                                                          default_group):
    from hpcgrad.elastic import runner as run_module
    monkeypatch.setattr(run_module, "_warned", False)
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    state = elastic.State(_model())
    calls = []

    @elastic.run(min_size=1)
    def train(state):
        calls.append(state.commits())
        return "done"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(state) == "done"
    assert calls == [[1]]  # committed once on entry
    assert any("a lost rank will end the job" in str(w.message) for w in caught)


def test_run_reraises_what_is_not_a_process_failure(monkeypatch, default_group):
    from hpcgrad.elastic import runner
    monkeypatch.setattr(runner, "_warned", True)

    @elastic.run
    def train(state):
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        train(elastic.State(_model()))


def test_recovery_timeout_setting_is_checked(monkeypatch):
    monkeypatch.setenv("HPCGRAD_ELASTIC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HPCGRAD_ELASTIC_TIMEOUT must be a number"):
        world.recovery_timeout()
    monkeypatch.setenv("HPCGRAD_ELASTIC_TIMEOUT", "2.5")
    assert world.recovery_timeout() == 2.5
