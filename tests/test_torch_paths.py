"""PyTorch's module paths and small functions a script reaches for after ``import hpcgrad as
torch`` (issue 27): each is the same object as hpcgrad's own, or behaves as PyTorch's."""

import subprocess
import sys

import pytest

import hpcgrad
import hpcgrad.data


def test_torch_utils_data_path_is_hpcgrad_data():
    import hpcgrad.utils.data as data
    from hpcgrad.utils.data.distributed import DistributedSampler

    for name in ("DataLoader", "Dataset", "TensorDataset", "Sampler", "RandomSampler",
                 "SequentialSampler", "BatchSampler", "DistributedSampler", "default_collate"):
        assert getattr(data, name) is getattr(hpcgrad.data, name), name
    assert DistributedSampler is hpcgrad.data.DistributedSampler


def test_cuda_is_there_after_import_hpcgrad():
    """torch.cuda needs no import of its own; a fresh process, so no other test imported it."""
    code = ("import hpcgrad; print(hpcgrad.cuda.is_available() in (True, False), "
            "hpcgrad.cuda.device_count() >= 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.mpi(min_size=1)
def test_get_backend_names_mpi():
    import hpcgrad.distributed as dist
    dist.init_process_group()
    assert dist.get_backend() == "mpi"
    group = dist.new_group()
    try:
        assert dist.get_backend(group) == "mpi"
    finally:
        dist.destroy_process_group(group)
    with pytest.raises(ValueError, match="Invalid process group specified"):
        dist.get_backend(dist.NON_GROUP_MEMBER)


def test_torchrun_variables_under_mpiexec(launch):
    """Before: a torchrun script's os.environ["LOCAL_RANK"] raised KeyError under mpiexec."""
    from pathlib import Path
    script = Path(__file__).parent / "scripts" / "torchrun_env.py"
    job = launch([sys.executable, str(script)], nprocs=2, timeout=90, mpiexec_timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output
    for rank in range(2):
        line = next(x for x in job.stdout.splitlines() if x.startswith(f"[rank {rank}]"))
        expected = [str(rank), "2", str(rank), "2"]  # one node: local ranks are the ranks
        assert f"after {expected} local {rank} 2" in line, line
        assert f"before ['{rank}', '2'," in line, line  # rank and size known at import


def test_nn_paths_of_the_new_layers():
    import hpcgrad.nn as nn
    import hpcgrad.nn.functional as F
    from hpcgrad.nn import _dropout2d, _embedding_bag, _packed
    from hpcgrad.nn.utils import rnn

    assert F.dropout2d is _dropout2d.dropout2d and F.embedding_bag is _embedding_bag.embedding_bag
    assert rnn.pack_padded_sequence is _packed.pack_padded_sequence
    assert nn.utils.rnn.PackedSequence is _packed.PackedSequence


@pytest.mark.mpi(min_size=1)
def test_default_backend_for_device_as_torch():
    import hpcgrad.distributed as dist
    torch = pytest.importorskip("torch")
    for device in ("cpu", "cuda", "cuda:1", hpcgrad.device("cpu")):
        assert dist.get_default_backend_for_device(device) == \
            torch.distributed.get_default_backend_for_device(str(device))
    with pytest.raises(ValueError, match="Default backend not registered for device"):
        dist.get_default_backend_for_device("tpu")


def test_accelerator_device_index_changes_nothing_without_with():
    hpcgrad.accelerator.device_index(None)  # PyTorch's ddp_rpc example calls it bare
    with hpcgrad.accelerator.device_index(None):
        pass


def test_accelerator_set_device_index_without_a_gpu_says_so():
    if hpcgrad.base.backend.device_count() > 0:
        pytest.skip("checks the error where no GPU exists")
    for device in (0, "cuda:0", hpcgrad.device("cuda", 0)):
        with pytest.raises(RuntimeError, match="no such GPU"):
            hpcgrad.accelerator.set_device_index(device)
    assert hpcgrad.accelerator.current_device_index() == -1
