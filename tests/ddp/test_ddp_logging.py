"""DistributedDataParallel._get_ddp_logging_data: bucket sizes by hand, unused parameters, the
comm hook, average times; PyTorch's key names (Note [DDP logging data])."""

import gc

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
from hpcgrad.ddp import buckets
from hpcgrad.distributed import comm_hooks
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

mpi = pytest.mark.mpi(min_size=1)
TIMES = ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
         "avg_backward_compute_comm_overlap_time")



class Chain(nn.Module):
    """Bias-free float64 layers 4 -> 3 -> 3 -> 2: weights of 96, 72 and 48 bytes whose gradients
    are ready strictly last to first. ``spare`` (4 -> 2, 64 bytes) joins the output when used."""

    def __init__(self, spare=False):
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False, dtype=np.float64)
        self.b = nn.Linear(3, 3, bias=False, dtype=np.float64)
        self.c = nn.Linear(3, 2, bias=False, dtype=np.float64)
        if spare:
            self.spare = nn.Linear(4, 2, bias=False, dtype=np.float64)

    def forward(self, x, use_spare=False):
        y = self.c(self.b(self.a(x).tanh()).tanh())
        return y + self.spare(x) if use_spare else y


def step(ddp, **kwargs):
    x = hg.tensor(np.random.default_rng(dist.get_rank()).standard_normal((5, 4)))
    ddp(x, **kwargs).sum().backward()


@mpi
def test_bucket_sizes_by_hand_before_and_after_the_rebuild(group, monkeypatch):
    # Limits of 100 bytes (the first bucket's too): at construction, in registration order,
    # a (96) + b (72) = 168 >= 100 closes a bucket and c (48) is left: reversed [[c], [a, b]].
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 100)
    ddp = DDP(Chain(), process_group=group, bucket_cap_mb=100 / 2 ** 20)
    data = ddp._get_ddp_logging_data()
    assert data["world_size"] == group.size() and data["rank"] == group.rank()
    assert data["bucket_cap_bytes"] == 100 and data["iteration"] == 0
    assert data["num_parameter_tensors"] == 3 and data["total_parameter_size_bytes"] == 216
    assert data["bucket_sizes"] == [48, 168] and data["bucket_num_parameters"] == [1, 2]
    assert data["num_buckets"] == 2
    assert data["has_rebuilt_buckets"] is False and data["rebuilt_bucket_sizes"] is None
    assert data["comm_hook"] is None and data["find_unused_parameters"] is False
    assert data["gradient_as_bucket_view"] is False and data["unused_parameter_names"] == []
    assert all(data[key] == 0 for key in TIMES)
    for _ in range(3):
        step(ddp)
    # Rebuilt at the second forward in ready order c, b, a: c (48) + b (72) = 120 >= 100, then a.
    data = ddp._get_ddp_logging_data()
    assert data["iteration"] == 3 and data["has_rebuilt_buckets"] is True
    assert data["prev_iteration_grad_ready_order_indices"] == [2, 1, 0]
    assert data["rebuilt_per_bucket_param_indices"] == [[2, 1], [0]]
    assert data["rebuilt_bucket_sizes"] == [120, 96]
    assert data["rebuilt_bucket_num_parameters"] == [2, 1] and data["num_buckets"] == 2
    assert data["bucket_sizes"] == [48, 168]  # as built at construction, as PyTorch's
    assert all(isinstance(data[key], int) and data[key] > 0 for key in TIMES)
    # By their definitions (first launch to the end of compute, within both):
    overlap = data["avg_backward_compute_comm_overlap_time"]
    assert data["avg_backward_comm_time"] >= overlap
    assert data["avg_backward_compute_time"] >= overlap


@mpi
def test_unused_parameters_seen(group):
    ddp = DDP(Chain(spare=True), process_group=group, find_unused_parameters=True)
    step(ddp, use_spare=True)
    data = ddp._get_ddp_logging_data()
    assert data["find_unused_parameters"] is True and data["unused_parameter_names"] == []
    step(ddp)
    data = ddp._get_ddp_logging_data()
    assert data["unused_parameter_names"] == ["spare.weight"]
    assert data["unused_parameter_size"] == 64
    step(ddp, use_spare=True)
    data = ddp._get_ddp_logging_data()
    assert data["unused_parameter_size"] == 0  # the last iteration used it
    assert data["unused_parameter_names"] == ["spare.weight"]  # seen once, kept
    assert data["has_rebuilt_buckets"] is False  # never with find_unused_parameters (PyTorch)
    assert all(data[key] > 0 for key in TIMES)


@mpi
def test_comm_hook_bucket_view_and_join(group):
    ddp = DDP(Chain(), process_group=group, gradient_as_bucket_view=True)
    ddp.register_comm_hook(group, comm_hooks.allreduce_hook)
    with ddp.join():
        step(ddp)
        step(ddp)
    data = ddp._get_ddp_logging_data()
    assert data["comm_hook"] == "allreduce_hook" and data["gradient_as_bucket_view"] is True
    assert data["join_uneven_inputs"] is True and data["iteration"] == 2  # averages: of 1
    assert data["bucket_sizes"] == [216] and data["bucket_num_parameters"] == [3]
    assert all(data[key] > 0 for key in TIMES)


def test_key_names_are_pytorchs():
    """Every key this DDP shares with PyTorch's DDP logging data has PyTorch's name (and the
    comm hook its name, as PyTorch's ``hook.__qualname__``)."""
    torch = pytest.importorskip("torch")
    tdist = pytest.importorskip("torch.distributed")
    if not tdist.is_available():
        pytest.skip("torch.distributed is not built")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    model = None
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        with model.join():
            for _ in range(3):  # PyTorch logs the rebuilt buckets at the third forward
                model(torch.ones(3, 4)).sum().backward()
        theirs = model._get_ddp_logging_data()
    finally:
        model = None  # torch's DDP before its gloo group, here (test_powersgd.py: why)
        gc.collect()
        tdist.destroy_process_group()
    shared = {"module_name", "rank", "world_size", "backend_name", "iteration",
              "num_parameter_tensors", "total_parameter_size_bytes", "dtypes",
              "bucket_cap_bytes", "bucket_sizes", "has_rebuilt_buckets", "rebuilt_bucket_sizes",
              "rebuilt_per_bucket_param_indices", "prev_iteration_grad_ready_order_indices",
              "find_unused_parameters", "unused_parameter_size", "comm_hook",
              "gradient_as_bucket_view", "broadcast_buffers", "join_uneven_inputs",
              "forward_compute_time", "backward_compute_time", "backward_comm_time",
              "backward_compute_comm_overlap_time", *TIMES}
    assert shared - set(theirs) == set()
    assert theirs["comm_hook"] == comm_hooks.allreduce_hook.__qualname__
