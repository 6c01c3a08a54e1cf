"""DDP defects of issue #10, each with a regression test, and ports of PyTorch's DDP tests of them.

Ported, in our words (names kept), from test/distributed/test_c10d_common.py,
test_c10d_gloo.py, test_c10d_nccl.py (test_fp16/test_bf16, on CPU here) and
torch/testing/_internal/distributed/distributed_test.py. Every multi-rank test runs on a fresh
communicator with a timeout, so a hang fails (CommTimeoutError) instead of stalling the run.

Left out: the use_reentrant=False and static_graph=True variants of the checkpointing tests
(static_graph's checkpointing is tested in test_ddp_pytorch_training.py),
test_ddp_checkpointing_dynamic_* (non-reentrant only), the
GPU-only comm hook tests (future_passing_gpu_*), and the authoritative-rank/logging checks of
_run_uneven_inputs_test (hpcgrad keeps no DDP logging data).
"""

import copy
import pickle
from collections import namedtuple
from contextlib import nullcontext

import ml_dtypes
import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad.distributed import comm_hooks
from hpcgrad.distributed import GradBucket
from hpcgrad.futures import Future
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.utils.checkpoint import checkpoint

from ddp_fixes_helpers import (CheckpointOnceModule, CheckpointTwiceModule,  # noqa: I100
                               DataclassOutputModule, DictOutputModule, ModuleForDdpCommHook,
                               SparseGradientModule, Task, UnusedParamTwoLinLayerNet,
                               ddp_checkpointing, grads_of, model_step, params_of,
                               same_on_all_ranks, timed_group)

mpi2 = pytest.mark.mpi(min_size=2)
READY_TWICE = "Expected to mark a variable ready only once."


@pytest.fixture
def group():
    with timed_group() as g:
        yield g


# --- activation checkpointing (test_c10d_common.py) -----------------------------------------
@mpi2
@pytest.mark.parametrize("use_bucket_view", [False, True])
def test_ddp_checkpointing_once(group, use_bucket_view):
    """DDP works as expected when a layer is checkpointed only once."""
    ddp_checkpointing(group, CheckpointOnceModule, use_bucket_view)


@mpi2
@pytest.mark.parametrize("use_bucket_view", [False, True])
def test_ddp_checkpointing_unused_params(group, use_bucket_view):
    """Reentrant checkpoint with find_unused_parameters: the checkpointed layer is not in the
    forward's graph, so it is marked unused, then its gradient shows up: raise."""
    with pytest.raises(RuntimeError, match=READY_TWICE):
        ddp_checkpointing(group, CheckpointOnceModule, use_bucket_view,
                          find_unused_parameters=True)


@mpi2
@pytest.mark.parametrize("find_unused_parameters", [False, True])
@pytest.mark.parametrize("use_bucket_view", [False, True])
def test_ddp_checkpointing_twice(group, use_bucket_view, find_unused_parameters):
    """The same layer checkpointed twice marks its parameters ready twice: raise, never reduce
    some gradients and let the replicas drift (the check is per parameter, not per bucket)."""
    with pytest.raises(RuntimeError, match=READY_TWICE):
        ddp_checkpointing(group, CheckpointTwiceModule, use_bucket_view,
                          find_unused_parameters=find_unused_parameters)


@mpi2
@pytest.mark.parametrize("use_bucket_view", [False, True])
def test_ddp_checkpointing_weight_sharing(group, use_bucket_view):
    """The whole DDP model checkpointed, with a weight shared by two layers: works. DDP's
    forward runs again inside the outer backward (the recompute)."""
    def make_model():
        l1, l2 = nn.Linear(20, 20), nn.Linear(20, 20)
        l1.weight = l2.weight
        return nn.Sequential(l1, l2)

    ddp_checkpointing(group, make_model, use_bucket_view, run_checkpoint=True)


class _UsedInsideAndOutsideCheckpoint(nn.Module):
    """l1 is used outside the checkpoint first, then inside it: backward runs the nested
    (checkpoint) backward before the outer AccumulateGrad of l1, and the nested backward
    completes the last bucket."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        a = self.l1(x)
        h = checkpoint(self.l1, x)
        return self.l2(h) + a


@mpi2
def test_finalize_waits_for_the_outer_backward(group):
    """Finalizing at the end of the nested backward would stop expecting hooks, and the outer
    backward's gradient for l1 would be added, unreduced, to the averaged one (the replicas
    drift silently). Queued on the outer backward, the second marking of l1 raises."""
    hg.manual_seed(0)
    ddp = DDP(_UsedInsideAndOutsideCheckpoint(), process_group=group)
    x = hg.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=READY_TWICE):
        ddp(x * (group.rank() + 1)).sum().backward()


@mpi2
def test_two_backwards_through_one_forward_finalize_in_the_second(group):
    """Two outputs, one loss and one backward each: the reduction completes in the second
    backward and finalizes there (the first backward's finished GraphTask takes no callback),
    so the next iteration starts cleanly."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.h0, self.h1 = nn.Linear(2, 3), nn.Linear(2, 3)

        def forward(self, x):
            return self.h0(x), self.h1(x)

    model = DDP(TwoHeads(), process_group=group)
    for _ in range(2):
        model.zero_grad()
        out0, out1 = model(hg.ones(1, 2) * (group.rank() + 1))
        out0.sum().backward()
        out1.sum().backward()
        mean = sum(r + 1 for r in range(group.size())) / group.size()
        for head in (model.module.h0, model.module.h1):
            np.testing.assert_allclose(head.weight.grad.array, np.full((3, 2), mean))


# --- comm hooks (test_c10d_gloo.py) -------------------------------------------------------------
def _simple_hook(state: object, bucket: GradBucket) -> Future:
    fut = Future()
    fut.set_result(hg.ones_like(bucket.buffer()))

    def fut_then(fut):
        t = fut.value()  # add ones to the result
        return t + t

    return fut.then(fut_then)


@mpi2
def test_ddp_comm_hook_future_passing_cpu(group):
    """The Future a hook returns is what DDP writes back: 2 * ones, not the average 0.25."""
    model = DDP(ModuleForDdpCommHook(), process_group=group)
    model.register_comm_hook(None, _simple_hook)
    model(8, group.rank()).mean().backward()
    for p in model.parameters():
        np.testing.assert_array_equal(p.grad.array, 2 * np.ones((2, 2)))


@mpi2
def test_ddp_invalid_comm_hook_init(group):
    model = DDP(ModuleForDdpCommHook(), process_group=group)
    with pytest.raises(TypeError, match="Communication hook must be callable."):
        model.register_comm_hook(state=None, hook=1)

    def comm_hook(state: object, bucket: int) -> Future:
        return Future()

    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket."):
        model.register_comm_hook(state=None, hook=comm_hook)

    def one_argument(bucket):
        return Future()

    with pytest.raises(TypeError, match=r"must take two arguments \(state, bucket\)"):
        model.register_comm_hook(state=None, hook=one_argument)


@mpi2
def test_ddp_invalid_comm_hook_return_type(group):
    model = DDP(ModuleForDdpCommHook(), process_group=group)

    def comm_hook(state: object, bucket: GradBucket) -> int:
        return Future()

    with pytest.raises(ValueError, match="Communication hook: return annotation should be "):
        model.register_comm_hook(state=None, hook=comm_hook)

    def returns_no_future(state: object, bucket: GradBucket):
        return 1

    model.register_comm_hook(state=None, hook=returns_no_future)
    with pytest.raises(RuntimeError, match="callback must return a .*Future object, but got int"):
        model(8, group.rank()).mean().backward()


@mpi2
def test_ddp_comm_hook_register_just_once(group):
    model = DDP(ModuleForDdpCommHook(), process_group=group)

    def dummy_hook(state, bucket):
        fut = Future()
        fut.set_result([bucket.buffer()])
        return fut

    model.register_comm_hook(None, dummy_hook)
    with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook can "
                                           "only be called once."):
        model.register_comm_hook(None, dummy_hook)


def _run_and_verify_sparse_gradients(group, vanilla_model, ddp_model):
    """Full batch on the single-process model, this rank's part on DDP: equal sparse grads."""
    mult, size, rank = 2, group.size(), group.rank()
    rng = np.random.default_rng(7)
    inp, target = rng.integers(0, 10, (mult * size, 2)), rng.integers(0, 10, mult * size)
    criterion = nn.CrossEntropyLoss()
    criterion(vanilla_model(hg.tensor(inp)), hg.tensor(target)).backward()
    part = slice(rank * mult, (rank + 1) * mult)
    criterion(ddp_model(hg.tensor(inp[part])), hg.tensor(target[part])).backward()
    want = next(vanilla_model.parameters()).grad
    got = next(ddp_model.parameters()).grad
    assert got.is_sparse
    np.testing.assert_allclose(got.to_dense().array, want.to_dense().array, rtol=1e-6, atol=1e-7)


@mpi2
@pytest.mark.parametrize("hook", ["none", "allreduce_hook", "custom"])
def test_ddp_comm_hook_sparse_gradients(group, hook):
    """test_sparse_gradients with and without a comm hook: a hook sees the sparse gradient as
    its bucket and returns the reduced one."""
    hg.manual_seed(1337)
    vanilla_model = SparseGradientModule()
    ddp_model = DDP(copy.deepcopy(vanilla_model), process_group=group)

    def allreduce_hook_gloo(state: object, bucket: GradBucket) -> Future:
        assert bucket.is_sparse()

        def div_by_world_size(fut):
            return fut.wait() * (1.0 / group.size())

        return comm_hooks.sparse_allreduce(group, bucket.buffer()).then(div_by_world_size)

    if hook != "none":
        ddp_model.register_comm_hook(
            group, comm_hooks.allreduce_hook if hook == "allreduce_hook" else allreduce_hook_gloo)
    _run_and_verify_sparse_gradients(group, vanilla_model, ddp_model)


# --- outputs left out of the loss, outputs in containers ------------------------------------
@mpi2
@pytest.mark.parametrize("module_cls", [UnusedParamTwoLinLayerNet, DictOutputModule],
                         ids=["tuple_module", "dict_module"])
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_output_unused_in_loss(group, module_cls, gradient_as_bucket_view):
    """distributed_test.py's _test_output_unused_in_loss: output "a" left out of the loss
    with find_unused_parameters=True; its weight keeps its gradient (None, or the saved one),
    everything equals local training, and no bucket is left unreduced."""
    hg.manual_seed(0)
    model = module_cls()
    local_net = copy.deepcopy(model)
    net = DDP(copy.deepcopy(model), process_group=group, find_unused_parameters=True,
              gradient_as_bucket_view=gradient_as_bucket_view)
    inp = hg.tensor(np.random.default_rng(0).standard_normal((10, 10)).astype(np.float32))

    def outputs(m):
        out = m(inp)
        return out["predictions"] if module_cls is DictOutputModule else out

    inner = (lambda m: m.module) if module_cls is DictOutputModule else (lambda m: m)
    a_dist, b_dist = outputs(net)
    b_dist.sum().backward()
    assert inner(net.module).a.weight.grad is None

    net.zero_grad()
    local_net.zero_grad()
    saved_local = saved_dist = None
    for i in range(6):
        a, b = outputs(local_net)
        a_dist, b_dist = outputs(net)
        if i < 2:  # both outputs used; later "a" is left out
            loss, loss_dist = (a @ b).sum(), (a_dist @ b_dist).sum()
        else:
            loss, loss_dist = b.sum(), b_dist.sum()
        loss.backward()
        loss_dist.backward()
        if i == 1:
            saved_local = inner(local_net).a.weight.grad.array.copy()
            saved_dist = inner(net.module).a.weight.grad.array.copy()
            np.testing.assert_allclose(saved_dist, saved_local, rtol=1e-5, atol=1e-5)
        elif i >= 2:
            np.testing.assert_array_equal(inner(net.module).a.weight.grad.array, saved_dist)
            np.testing.assert_array_equal(inner(local_net).a.weight.grad.array, saved_local)
        for (name, p), q in zip(local_net.named_parameters(), net.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                np.testing.assert_allclose(q.grad.array, p.grad.array, rtol=1e-5, atol=1e-5,
                                           err_msg=f"iteration {i}: {name}")
    same_on_all_ranks(group, grads_of(net))


@mpi2
@pytest.mark.parametrize("skip_o1", [False, True], ids=["test_dataclass_output",
                                                      "test_dataclass_output_unused_param"])
def test_dataclass_output(group, skip_o1):
    """Outputs inside a dataclass (and a dict in it) are found; with o1 None, seq1 is unused.
    Full batch locally vs this rank's rows under DDP: equal gradients."""
    size, rank = group.size(), group.rank()
    net_x = hg.tensor(np.concatenate([np.ones((4, 10), np.float32) * i for i in range(size)]))
    ddp_x = hg.tensor(np.ones((4, 10), np.float32) * rank)
    hg.manual_seed(0)
    net = DataclassOutputModule(skip_o1)
    ddp = DDP(copy.deepcopy(net), process_group=group, find_unused_parameters=True)

    def loss(out):
        total = out.o2["a"] + out.o2["b"] if skip_o1 else out.o1 + out.o2["a"] + out.o2["b"]
        return F.mse_loss(total, hg.ones_like(out.o2["a"]))

    loss(net(net_x)).backward()
    loss(ddp(ddp_x)).backward()
    for (name, p1), p2 in zip(net.named_parameters(), ddp.parameters()):
        if p1.grad is None:
            assert p2.grad is None, name
        else:
            np.testing.assert_allclose(p2.grad.array, p1.grad.array, rtol=1e-5, atol=1e-6,
                                       err_msg=name)


Pair = namedtuple("Pair", ["used", "left_out"])


class _TwoHeads(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.used, self.left_out = nn.Linear(3, 2), nn.Linear(3, 2)
        self.container = container

    def forward(self, x):
        used, left_out = self.used(x), self.left_out(x)
        if self.container == "namedtuple":
            return Pair(used, left_out)
        if self.container == "set":
            self.last_used = used  # the test finds it in the set by identity
            return ({used, left_out},)
        return [{"nested": (used,)}, left_out]


@mpi2
@pytest.mark.parametrize("container", ["namedtuple", "set", "nested"])
def test_outputs_in_containers_left_out_of_the_loss(group, container):
    """Every output is found wherever it sits, and the one left out of the loss leaves its
    layer unused for this iteration: the used layer is averaged, the other keeps None, and
    the next iteration starts cleanly."""
    hg.manual_seed(0)
    ddp = DDP(_TwoHeads(container), process_group=group, find_unused_parameters=True)
    rank, size = group.rank(), group.size()
    for _ in range(2):
        out = ddp(hg.ones(1, 3) * (rank + 1))
        if container == "namedtuple":
            used = out.used
        elif container == "set":
            used = next(t for t in out[0]  # the set holds it, or the sink's view of it
                        if np.shares_memory(t.array, ddp.module.last_used.array))
        else:
            used = out[0]["nested"][0]
        used.sum().backward()
        assert ddp.module.left_out.weight.grad is None
        mean = sum(r + 1 for r in range(size)) / size
        np.testing.assert_allclose(ddp.module.used.weight.grad.array, np.full((2, 3), mean))
        ddp.zero_grad()


class _GlobalLocalUnusedParamModule(nn.Module):
    """t0 used on rank 0 only, t1 on the other ranks, task_unused nowhere (test_c10d_gloo)."""

    def __init__(self, all_on_rank_0=False):
        super().__init__()
        self.t0, self.t1 = Task(), Task()
        self.task_unused = None if all_on_rank_0 else Task()
        self.all_on_rank_0 = all_on_rank_0

    def forward(self, x, rank):
        if self.all_on_rank_0:  # FindUnusedParamModule: rank 0 uses every parameter
            return self.t1(self.t0(x)) if rank == 0 else self.t1(x)
        return self.t0(x) if rank == 0 else self.t1(x)


@mpi2
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=[
    "test_global_local_unused_params_grad",
    "test_global_local_unused_params_grad_with_grad_is_view"])
def test_global_local_unused_params_grad(group, gradient_as_bucket_view):
    """Locally unused parameters get the average on every rank; the globally unused one keeps
    None."""
    model = DDP(_GlobalLocalUnusedParamModule(), process_group=group,
                find_unused_parameters=True, gradient_as_bucket_view=gradient_as_bucket_view)
    t0, t1, unused = model.module.t0.p, model.module.t1.p, model.module.task_unused.p
    output = model(8, group.rank())
    assert t0.grad is None and t1.grad is None and unused.grad is None
    output.mean().backward()
    size = group.size()
    np.testing.assert_allclose(t0.grad.array, np.full((2, 2), 0.25 / size))
    np.testing.assert_allclose(t1.grad.array, np.full((2, 2), 0.25 * (size - 1) / size))
    assert unused.grad is None


@mpi2
def test_find_unused_parameters_when_unused_parameters_empty(group):
    """Rank 0 uses every parameter (its unused list is empty), the others do not: DDP still
    all-reduces the used-map, and every parameter gets a gradient everywhere."""
    model = DDP(_GlobalLocalUnusedParamModule(all_on_rank_0=True), process_group=group,
                find_unused_parameters=True)
    output = model(8, group.rank())
    assert all(p.grad is None for p in model.parameters())
    output.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


class _IgnoredOutput(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False) if unused else None
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(x, dim=1)


@mpi2
@pytest.mark.parametrize("unused", [False, True], ids=[
    "test_ignored_output", "test_ignored_output_with_unused_parameters"])
def test_ignored_output(group, unused):
    """A forward's output may be dropped without backward (no collective waits for it), with
    or without parameters that take no part in the output."""
    model = DDP(_IgnoredOutput(unused), process_group=group, find_unused_parameters=unused)
    rng = np.random.default_rng(group.rank())
    inp = hg.tensor(rng.random((4, 2)).astype(np.float32))
    target = hg.tensor(rng.integers(0, 4, 4))
    criterion = nn.CrossEntropyLoss()
    for _ in range(4):
        output = model(inp)
        del output
    for _ in range(4):
        criterion(model(inp), target).backward()
    same_on_all_ranks(group, grads_of(model))


@mpi2
def test_ddp_uneven_input_exception(group):
    """An exception inside join() reaches the caller; join() does not swallow it or wait."""
    class ExceptionModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.param = nn.Parameter(hg.ones(1))

        def forward(self, _):
            raise ValueError("Intentional error")

    net = DDP(ExceptionModule(), process_group=group)
    with pytest.raises(ValueError, match="Intentional error"):
        with net.join():
            net(hg.ones(1)).sum().backward()


# --- unused-parameter errors (distributed_test.py) ----------------------------------------------
@mpi2
def test_ddp_unused_params_rebuild_buckets_exception(group):
    """The second iteration reports the unused parameter (by index and name) instead of
    failing in the bucket rebuild."""
    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 10, bias=False)
            self.net2 = nn.Linear(10, 10, bias=False)

        def forward(self, x):
            return self.net1(x)

    ddp = DDP(ToyModel(), process_group=group)
    ddp(hg.rand(1, 10)).sum().backward()
    with pytest.raises(RuntimeError) as error:
        ddp(hg.rand(1, 10)).sum().backward()
    msg = str(error.value)
    for s in ["Expected to have finished reduction in the prior iteration",
              "passing the keyword argument `find_unused_parameters=True`",
              "`forward` function outputs participate in calculating loss",
              f"Parameter indices which did not receive grad for rank {group.rank()}: 1\n",
              f"did not receive grad for rank {group.rank()}: net2.weight"]:
        assert s in msg, f"expected {s!r} in {msg!r}"
    assert "Since `find_unused_parameters=True` is enabled" not in msg


# --- uneven inputs: join() (distributed_test.py) -------------------------------------------------
class _JoinNet(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 4), nn.Linear(4, 1)
        self.fc3 = nn.Linear(4, 1) if unused else None

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _mappings(size):
    """_test_ddp_uneven_inputs' rank -> iterations: early ranks at baseline (one rank, or all
    but the last; later early ranks offset // 2 more), the others at baseline + offset."""
    found = []
    for early in sorted({1, size - 1}):
        for baseline in (0, 5):
            for offset in (2, 3):
                mapping = {r: baseline + (offset // 2 if 0 < r else 0) for r in range(early)}
                mapping.update({r: baseline + offset for r in range(early, size)})
                found.append(mapping)
    return found


def _run_uneven_inputs_test(group, model, sync_interval, throw, mapping, find_unused):
    rank = group.rank()
    net = DDP(model, process_group=group, bucket_cap_mb=1, find_unused_parameters=find_unused)
    num_iters, min_iters = mapping[rank], min(mapping.values())
    if throw:
        ctx = pytest.raises(RuntimeError, match=f"Rank {rank} exhausted all inputs"
                            if num_iters == min_iters else
                            "Detected at least one rank that exhausted inputs.")
    else:
        ctx = nullcontext()
    total = 0
    inp = hg.ones(3, 2)
    with ctx:
        with net.join(throw_on_early_termination=throw):
            for i in range(num_iters):
                with net.no_sync() if i % sync_interval else nullcontext():
                    net(inp).sum().backward()
                    model_step(net)
                total += 1
    if throw:
        assert total == min_iters
    else:
        assert total >= min_iters
        same_on_all_ranks(group, params_of(net))


@mpi2
@pytest.mark.parametrize("sync_interval", [1, 2, 3])
@pytest.mark.parametrize("throw_on_early_termination", [False, True])
@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_uneven_inputs(group, sync_interval, throw_on_early_termination, find_unused):
    """join() with no_sync() every sync_interval iterations, including a rank with no input at
    all: a joined rank shadows only the synced iterations (it used to replay an all-reduce the
    active ranks never posted, and hang), or with throw_on_early_termination every rank raises
    at the iteration the first one runs out."""
    for mapping in _mappings(group.size()):
        hg.manual_seed(0)
        _run_uneven_inputs_test(group, _JoinNet(find_unused), sync_interval,
                                throw_on_early_termination, mapping, find_unused)


@mpi2
def test_ddp_uneven_input_join_disable(group):
    """join(enable=False) with even inputs divides by the world size as without join."""
    hg.manual_seed(group.rank())
    net = DDP(nn.Linear(1, 1), process_group=group)
    inp = hg.ones(1) * group.rank()
    size = group.size()
    with net.join(enable=False):
        for _ in range(5):
            net.zero_grad()
            net(inp).sum().backward()
            assert net.module.weight.grad.item() == pytest.approx(sum(range(size)) / size)
    same_on_all_ranks(group, params_of(net))


# --- bucket rebuild ----------------------------------------------------------------------------
@mpi2
def test_forward_on_one_rank_runs_no_collective(group):
    """Evaluation with grad enabled on rank 0 only, before any backward: no bucket-rebuild
    broadcast (it would wait for the other ranks, which never call it); training goes on."""
    hg.manual_seed(0)
    net = DDP(nn.Linear(3, 2), process_group=group, broadcast_buffers=False)
    if group.rank() == 0:
        for _ in range(3):
            net(hg.ones(2, 3))
    for step in range(3):
        net.zero_grad()
        net(hg.ones(2, 3) * (group.rank() + 1)).sum().backward()
        mean = sum(r + 1 for r in range(group.size())) / group.size()
        np.testing.assert_allclose(net.module.weight.grad.array, np.full((2, 3), 2 * mean))
    assert net.reducer.has_rebuilt_buckets
    same_on_all_ranks(group, grads_of(net))


# --- layout and post-hooks --------------------------------------------------------------------
class _Transposed(nn.Module):
    """A weight stored column-major (Fortran order), as a transposed parameter would be."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(hg.zeros(4, 3, dtype=np.float64))
        self.w.array = np.arange(12.0).reshape(4, 3).T  # (3, 4), F-contiguous
        self.b = nn.Parameter(hg.zeros(4, dtype=np.float64))

    def forward(self, x):
        return x @ self.w + self.b


@mpi2
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_bucket_views_follow_parameter_strides(group, gradient_as_bucket_view):
    """The seed's gradient layout contract: a bucket view has its parameter's strides, so
    with gradient_as_bucket_view .grad is laid out like the parameter; values are right."""
    net = DDP(_Transposed(), process_group=group, gradient_as_bucket_view=gradient_as_bucket_view)
    w = net.module.w
    assert w.array.flags.f_contiguous and not w.array.flags.c_contiguous
    b, k = net.reducer.locators[net.reducer.names.index("w")]
    bucket = net.reducer.buckets[b]
    assert bucket.views_in[k].strides == w.array.strides
    x = np.ones((2, 3)) * (group.rank() + 1)
    net(hg.tensor(x)).sum().backward()
    mean = sum(r + 1 for r in range(group.size())) / group.size()
    np.testing.assert_allclose(w.grad.array, np.full((3, 4), 2 * mean))
    if gradient_as_bucket_view:
        assert w.grad.array.strides == w.array.strides
        assert np.shares_memory(w.grad.array, bucket.contents)


@mpi2
def test_post_hook_after_ddp_does_not_change_what_is_reduced(group):
    """DDP copies a gradient into its bucket in its own hook (as the seed): a user post-hook
    registered later on the same AccumulateGrad that scales .grad in place changes nothing
    reduced, and finalize writes the average over it."""
    hg.manual_seed(0)
    net = DDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), process_group=group)
    reference = copy.deepcopy(net.module)
    last = net.module[1].weight  # the first gradient ready; its bucket waits for the others
    assert len(net.reducer.buckets) == 1
    last._get_accumulator().register_hook(lambda grad_inputs, grad_outputs:
                                          last.grad.array.__imul__(100.0))
    size = group.size()
    xs = [np.full((2, 3), r + 1.0, np.float32) for r in range(size)]
    net(hg.tensor(xs[group.rank()])).sum().backward()
    for x in xs:
        (reference(hg.tensor(x)).sum() * (1.0 / size)).backward()
    for (name, p), q in zip(reference.named_parameters(), net.module.parameters()):
        np.testing.assert_allclose(q.grad.array, p.grad.array, rtol=1e-6, err_msg=name)


# --- half-precision parameters (test_c10d_nccl.py's test_fp16 / test_bf16, on CPU) ----------
@mpi2
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["test_fp16", "test_bf16"])
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_fp16(group, dtype, gradient_as_bucket_view):
    """A Linear(1, 1) in half precision with input 2**15: the gradient is divided by the world
    size before the reduction, so nothing overflows; it is exactly 2**15 on every rank."""
    model = nn.Linear(1, 1, bias=False)
    model.weight.array = np.ones((1, 1), dtype)
    net = DDP(model, process_group=group, bucket_cap_mb=0.001,
              gradient_as_bucket_view=gradient_as_bucket_view)
    net(hg.tensor(np.array([[2.0 ** 15]], dtype))).sum().backward()
    grad = net.module.weight.grad.array
    assert grad.dtype == np.dtype(dtype)
    assert np.isfinite(grad.astype(np.float32)).all()
    assert grad.astype(np.float32)[0, 0] == 2.0 ** 15


# --- pickling (distributed_test.py's _test_DistributedDataParallel, "serializable") ---------
@mpi2
def test_ddp_pickle_and_deepcopy():
    """A DDP over the default group survives pickle and deepcopy: the reducer is rebuilt over
    the copied parameters, and the copy trains like the original. Another group refuses."""
    dist.init_process_group()
    hg.manual_seed(0)
    net = DDP(nn.Linear(3, 2))
    rank, size = dist.get_rank(), dist.get_world_size()
    for copied in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert copied.reducer is not net.reducer
        assert copied.reducer.params[0] is copied.module.weight
        assert copied.module.weight is not net.module.weight
        copied(hg.ones(1, 3) * (rank + 1)).sum().backward()
        mean = sum(r + 1 for r in range(size)) / size
        np.testing.assert_allclose(copied.module.weight.grad.array, np.full((2, 3), mean))
    with timed_group() as other:
        with pytest.raises(RuntimeError, match="DDP Pickling/Unpickling are only supported when "
                                               "using DDP with the default process group"):
            pickle.dumps(DDP(nn.Linear(3, 2), process_group=other))
