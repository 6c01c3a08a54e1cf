"""Shared helpers of the DDP conformance tests: a timed group, PyTorch's test models, checks."""

import contextlib
import copy
from dataclasses import dataclass
from typing import Optional

import numpy as np
from ddp_helpers import ModuleForDdpCommHook, Task  # noqa: F401  (PyTorch's models, defined once)

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.utils.checkpoint import checkpoint

# A hang (a collective one rank never joins) fails the test after this long with a
# CommTimeoutError naming the call, instead of holding the run until MPIEXEC_TIMEOUT.
GROUP_TIMEOUT = 15


@contextlib.contextmanager
def timed_group(timeout=GROUP_TIMEOUT):
    """A fresh communicator with a timeout (as tests/conftest.py's ``group``):
    what one test leaves pending stays out of the next."""
    dist.init_process_group()
    group = dist.new_group(timeout=timeout)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def same_on_all_ranks(group, arrays):
    """{name: array} equal bit for bit on every rank (replicas must not drift)."""
    everyone = group.comm.allgather({k: np.asarray(v) for k, v in arrays.items()})
    for rank, theirs in enumerate(everyone):
        for name, value in theirs.items():
            assert np.array_equal(value, everyone[0][name], equal_nan=True), \
                f"{name} differs between rank {rank} and rank 0"


def params_of(model):
    return {n: p.array for n, p in model.named_parameters()}


def grads_of(model):
    return {n: p.grad.array for n, p in model.named_parameters() if p.grad is not None}


def model_step(model):
    """distributed_test.py's _model_step: p += p.grad, then grad = None."""
    for p in model.parameters():
        if p.grad is not None:
            p.array += p.grad.array
            p.grad = None


# --- PyTorch's test models (test_c10d_common.py, distributed_test.py), in hpcgrad ------------
class SparseGradientModule(nn.Module):
    """nn.EmbeddingBag(10, 10, sparse=True) (mode "mean") as an Embedding averaged per bag."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 10, sparse=True)

    def forward(self, x):
        return F.softmax(self.embedding(x).mean(dim=1), dim=1)


class CheckpointOnceModule(nn.Module):
    """Runs (reentrant) checkpoint for a single layer in the model."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.l2 = nn.Linear(20, 20)

    def forward(self, inp):
        x = self.l1(inp)
        return checkpoint(self.l2, x, use_reentrant=True)


class CheckpointTwiceModule(CheckpointOnceModule):
    """Runs checkpoint for the same layer twice (as pipeline parallelism may)."""

    def forward(self, inp):
        x = self.l1(inp)
        x = checkpoint(self.l2, x, use_reentrant=True)
        return checkpoint(self.l2, x, use_reentrant=True)


class UnusedParamTwoLinLayerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.c = nn.Linear(5, 5, bias=False)

    def forward(self, x):
        return (self.a(x), self.b(x))


class DictOutputModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = UnusedParamTwoLinLayerNet()

    def forward(self, x):
        predictions = self.module(x)
        loss = (predictions[0] + predictions[1]).sum()
        return {"predictions": predictions, "loss": loss}


@dataclass
class CustomOutput:
    o1: Optional[hg.Tensor]
    o2: dict


class DataclassOutputModule(nn.Module):
    def __init__(self, skip_o1):
        super().__init__()
        self.seq1 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.relu = nn.ReLU()
        self.seq2 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])
        self.skip_o1 = skip_o1

    def forward(self, x):
        o1 = None if self.skip_o1 else self.relu(self.seq1(x))
        o2 = {"a": self.seq2(x), "b": self.relu(self.seq2(x))}
        return CustomOutput(o1=o1, o2=o2)


# --- the checkpointing comparison (test_c10d_common's _test_ddp_checkpointing) -------------
def prepare_dummy_data(rank, size, ddp_bs=16):
    """The whole batch (the same on every rank) and this rank's slice of it."""
    hg.manual_seed(1234)
    inp = hg.rand(ddp_bs * size, 20, requires_grad=True)
    target = hg.randn(ddp_bs * size, 20)
    part = slice(rank * ddp_bs, (rank + 1) * ddp_bs)
    return inp, inp[part], target, target[part]


def train_model(model, inp, target, run_checkpoint=False):
    output = checkpoint(model, inp, use_reentrant=True) if run_checkpoint else model(inp)
    F.mse_loss(output, target).backward()


def ddp_checkpointing(group, make_model, use_bucket_view, find_unused_parameters=False,
                      run_checkpoint=False, n_iters=5):
    """Single-process full-batch model and DDP over this rank's slice, 5 iterations: every
    gradient equal within PyTorch's tolerance (rtol 1.3e-6, atol 5e-5, float32).
    ``make_model()`` builds the model after seeding, so every rank builds the same one."""
    hg.manual_seed(31415)
    input_model = make_model()
    model = copy.deepcopy(input_model)
    ddp_model = DDP(copy.deepcopy(input_model), bucket_cap_mb=1, process_group=group,
                    gradient_as_bucket_view=use_bucket_view,
                    find_unused_parameters=find_unused_parameters)
    inp, ddp_inp, target, ddp_target = prepare_dummy_data(group.rank(), group.size())
    for _ in range(n_iters):
        model.zero_grad(set_to_none=False)
        ddp_model.zero_grad(set_to_none=False)
        train_model(model, inp, target, run_checkpoint)
        train_model(ddp_model, ddp_inp, ddp_target, run_checkpoint)
        for (name, p), q in zip(model.named_parameters(), ddp_model.parameters()):
            assert p.grad is not None and q.grad is not None, name
            np.testing.assert_allclose(q.grad.array, p.grad.array, rtol=1.3e-6, atol=5e-5,
                                       err_msg=name)
    same_on_all_ranks(group, grads_of(ddp_model))
    return ddp_model
