"""DataLoader's full PyTorch signature (issue 27): worker threads (Note [Loader workers are
threads]), batch_sampler, pin_memory, and PyTorch's argument errors."""

import threading
import time

import numpy as np
import pytest

from hpcgrad.data import BatchSampler, DataLoader, Dataset, SequentialSampler, TensorDataset
import hpcgrad as hg


class Squares(Dataset):
    def __init__(self, n, delay=0.0, fail_at=None):
        self.n, self.delay, self.fail_at = n, delay, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay * ((i * 7) % 3))  # uneven: later items may finish first
        if i == self.fail_at:
            raise KeyError(f"item {i} is broken")
        return np.array([i, i * i], np.float32), i


def batches(loader):
    return [(x.array.tolist(), y.array.tolist()) for x, y in loader]


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_give_the_same_batches_in_order(workers):
    plain = batches(DataLoader(Squares(23), batch_size=4))
    threaded = DataLoader(Squares(23, delay=0.002), batch_size=4, num_workers=workers,
                          prefetch_factor=2)
    assert batches(threaded) == plain
    assert batches(threaded) == plain  # a second epoch


def test_shuffled_epochs_with_a_generator_match_the_plain_loader():
    plain = DataLoader(Squares(17), batch_size=5, shuffle=True,
                       generator=np.random.default_rng(3))
    threaded = DataLoader(Squares(17), batch_size=5, shuffle=True, num_workers=2,
                          generator=np.random.default_rng(3))
    assert [batches(plain) for _ in range(2)] == [batches(threaded) for _ in range(2)]


def test_worker_init_fn_runs_on_each_worker_thread_and_persistent_workers_stay():
    seen, names = [], set()

    def init(worker_id):
        seen.append((worker_id, threading.current_thread().name))

    class Named(Squares):
        def __getitem__(self, i):
            names.add(threading.current_thread().name)
            return super().__getitem__(i)

    loader = DataLoader(Named(40, delay=0.001), batch_size=2, num_workers=3,
                        worker_init_fn=init, persistent_workers=True)
    batches(loader)
    first = set(names)
    batches(loader)
    assert sorted(i for i, _ in seen) == list(range(len(seen))) and 1 <= len(seen) <= 3
    assert all(name.startswith("hpcgrad-loader") for _, name in seen)
    assert names == first  # the same threads served the second epoch


def test_a_workers_exception_reaches_the_consumer():
    with pytest.raises(KeyError, match="item 5 is broken"):
        batches(DataLoader(Squares(12, fail_at=5), batch_size=3, num_workers=2))


def test_timeout_bounds_the_wait_for_a_batch():
    class Slow(Squares):
        def __getitem__(self, i):
            time.sleep(0.5)
            return super().__getitem__(i)

    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.05 seconds"):
        batches(DataLoader(Slow(4), batch_size=2, num_workers=1, timeout=0.05))


def test_batch_sampler_and_pin_memory():
    ds = TensorDataset(hg.tensor(np.arange(10.0)), hg.tensor(np.arange(10)))
    sampler = BatchSampler(SequentialSampler(ds), 3, drop_last=True)
    loader = DataLoader(ds, batch_sampler=sampler, pin_memory=True)
    assert [y.array.tolist() for _, y in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(loader) == 3


@pytest.mark.parametrize("kwargs", [dict(num_workers=-1), dict(prefetch_factor=2),
                                    dict(persistent_workers=True), dict(timeout=-1),
                                    dict(batch_sampler=[[0, 1]], batch_size=2),
                                    dict(batch_sampler=[[0, 1]], drop_last=True)])
def test_argument_errors_match_torch(kwargs):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError) as theirs:
        torch.utils.data.DataLoader(list(range(4)), **kwargs)
    with pytest.raises(ValueError) as ours:
        DataLoader(Squares(4), **kwargs)
    assert str(ours.value) == str(theirs.value)
