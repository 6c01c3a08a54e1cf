"""DataLoader worker processes (Note [Loader worker processes]): spawn/forkserver pools give the
same batches, in order, as no workers; fork is refused; get_worker_info answers in workers."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.data import DataLoader, Dataset, TensorDataset, get_worker_info


class Squares(Dataset):
    """A Python-level dataset (not TensorDataset), which is where processes pay off."""

    def __len__(self):
        return 23

    def __getitem__(self, i):
        info = get_worker_info()
        return np.float32(i * i), -1 if info is None else info.id


def record_worker(worker_id):
    assert get_worker_info().id == worker_id


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_processes_give_the_batches_of_no_workers(context):
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context=context,
                        worker_init_fn=record_worker)
    plain = DataLoader(Squares(), batch_size=4)
    got, want = list(loader), list(plain)
    assert len(got) == len(want) == 6
    for (values, ids), (plain_values, plain_ids) in zip(got, want):
        np.testing.assert_array_equal(values.numpy(), plain_values.numpy())
        assert set(ids.tolist()) <= {0, 1} and set(plain_ids.tolist()) == {-1}
    assert -1 not in {i for _, ids in got for i in ids.tolist()}  # loaded in the workers


def test_persistent_process_workers_serve_two_epochs_of_a_tensor_dataset():
    data = TensorDataset(hg.arange(10.0).reshape(10, 1), hg.arange(10))
    loader = DataLoader(data, batch_size=3, num_workers=2, multiprocessing_context="spawn",
                        persistent_workers=True)
    for _ in range(2):
        batches = list(loader)
        np.testing.assert_array_equal(np.concatenate([y.numpy() for _, y in batches]),
                                      np.arange(10))
    loader._stop_pool()


def test_fork_is_refused_and_thread_workers_have_worker_info():
    with pytest.raises(ValueError, match="forking a process that has started MPI"):
        DataLoader(Squares(), num_workers=2, multiprocessing_context="fork")
    with pytest.raises(ValueError, match="'spawn', 'forkserver'"):
        DataLoader(Squares(), num_workers=2, multiprocessing_context="threads")
    ids = [int(i) for _, batch_ids in DataLoader(Squares(), batch_size=5, num_workers=2)
           for i in batch_ids.tolist()]
    assert set(ids) <= {0, 1} and get_worker_info() is None
