"""DDP against single-process full-batch training in every mode; uneven inputs; misuse errors.

Multi-rank tests run at whatever size mpiexec gives (tests/run.sh: 1, 2 and 3 ranks). Each rank
trains its shard with DDP and, locally, a reference: the same model from rank 0's initial values,
trained single-process on the whole batch, float64. Exact modes agree to EXACT; the compressing
comm hooks within fp16_bound / bf16_bound of each step's exact average.
"""

import contextlib
import gc
from dataclasses import dataclass, field

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
from hpcgrad.ddp import buckets
from hpcgrad.distributed import comm_hooks
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

IN, HID, OUT, VOCAB = 5, 6, 3, 11
PER_RANK = 6  # samples per rank and step; divisible by the no_sync micro-steps
STEPS = 3  # buckets are rebuilt at the second step: steps 2 and 3 run on the rebuilt ones
LR = 0.1
# float64 with parameters and gradients of order 1: DDP and the reference differ only in the
# order of summation (per-rank means averaged vs one mean over the batch), ~1e-16 relative.
EXACT = 1e-12


# The compressing hooks, elementwise on each step's averaged gradient g = sum_r g_r / N, with
# S = sum_r |g_r| / N: |g_hook - g| <= factor * S + floor. (1.01: the second-order terms.)
def fp16_bound(n):
    """Every rank's g_r / N and each of the N - 1 partial sums is rounded once to float16
    (unit roundoff 2^-11, subnormal spacing 2^-24): N 2^-11 S + N 2^-24."""
    return 1.01 * n * 2.0 ** -11, n * 2.0 ** -24


def bf16_bound(n):
    """Every rank's g_r / N is rounded to float32, then to bfloat16 (2^-8); the N terms are
    summed in float32 (2^-24 each): (2^-8 + N 2^-24) S."""
    return 1.01 * (2.0 ** -8 + n * 2.0 ** -24), 0.0


def fp16_wrapper_bound(n):
    """fp16_compress_wrapper(allreduce_hook): g_r rounded to float16, then divided by N (a
    second rounding unless N is a power of 2), then summed as fp16_compress_hook's."""
    return 1.01 * (n + 1) * 2.0 ** -11, (n + 1) * 2.0 ** -24


def bf16_wrapper_bound(n):
    """bf16_compress_wrapper(allreduce_hook): g_r rounded to bfloat16, divided by N (rounded
    again), summed in float32 by MPI (hpcgrad.comm.buffers), the sum rounded once to bfloat16:
    (3 2^-8 + N 2^-24) S."""
    return 1.01 * (3 * 2.0 ** -8 + n * 2.0 ** -24), 0.0


# Several buckets: with these limits Net's 8 float64 parameters make 5 buckets of 1 or 2.
FIRST_BUCKET_BYTES, BUCKET_CAP_MB = 128, 256 / 2 ** 20

mpi = pytest.mark.mpi(min_size=1)




# --- models, data, training steps ------------------------------------------------------------
class Net(nn.Module):
    """An MLP whose layers are registered out of forward order, so the observed gradient-ready
    order differs from the initial reversed-registration buckets and a bucket can be ready
    before the ones that must be launched first. ``heads``: ``head`` joins the output when
    ``use_head`` (rank 0 only, in the tests); ``dead`` is never used."""

    def __init__(self, heads=False):
        super().__init__()
        self.out = nn.Linear(HID, OUT)
        self.inp = nn.Linear(IN, HID)
        self.mid = nn.Linear(HID, HID)
        self.mid2 = nn.Linear(HID, HID)
        if heads:
            self.head = nn.Linear(HID, OUT)
            self.dead = nn.Linear(HID, OUT)

    def forward(self, x, use_head=False):
        h = self.mid2(self.mid(self.inp(x).tanh()).tanh()).tanh()
        y = self.out(h)
        return y + self.head(h) if use_head else y


class Bag(nn.Module):
    """Embedding rows -> linear; sparse=True on the DDP side, a dense gradient in the reference."""

    def __init__(self, sparse):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HID, sparse=sparse)
        self.out = nn.Linear(HID, OUT)

    def forward(self, idx):
        return self.out(self.emb(idx).tanh())


@dataclass(frozen=True)
class Case:
    ddp: dict = field(default_factory=dict)  # DistributedDataParallel keyword arguments
    several_buckets: bool = False  # FIRST_BUCKET_BYTES and BUCKET_CAP_MB: 3+ buckets
    hook: object = None  # comm hook, registered with the test's group as state
    bound: object = None  # N -> (factor, floor) of the hook's error bound; None: EXACT
    micro: int = 1  # micro-steps per step, all but the last under no_sync()
    heads: bool = False  # Net(heads=True): head used on rank 0 only, dead used nowhere
    sparse: bool = False  # Bag with Embedding(sparse=True)

    @property
    def view(self):
        return self.ddp.get("gradient_as_bucket_view", False)


def allreduce_into_new_array(group, bucket):
    """A comm hook whose result is a new array, not the bucket: DDP must read and copy it back."""
    averaged = bucket.buffer().array / group.size()
    return group.iallreduce(averaged).get_future().then(lambda fut: averaged)


VIEW = {"gradient_as_bucket_view": True}
UNUSED = {"find_unused_parameters": True}
MODES = {
    "default": Case(),
    "gradient_as_bucket_view": Case(VIEW),
    "several_buckets": Case(several_buckets=True),
    "several_buckets_as_view": Case(VIEW, several_buckets=True),
    "find_unused_parameters": Case(UNUSED, heads=True),
    "find_unused_parameters_as_view": Case({**UNUSED, **VIEW}, several_buckets=True, heads=True),
    "no_sync": Case(micro=3),
    # Note [Static graph]: the first iteration reduces at its end, later ones per bucket.
    "static_graph": Case({"static_graph": True}),
    "static_graph_several_buckets_as_view": Case({"static_graph": True, **VIEW},
                                                 several_buckets=True),
    "static_graph_unused": Case({"static_graph": True}, several_buckets=True, heads=True),
    "static_graph_no_sync": Case({"static_graph": True}, micro=3),
    "no_sync_as_view": Case(VIEW, micro=3),
    "allreduce_hook": Case(several_buckets=True, hook=comm_hooks.allreduce_hook),
    "hook_returning_new_array": Case(several_buckets=True, hook=allreduce_into_new_array),
    "hook_returning_new_array_as_view": Case(VIEW, hook=allreduce_into_new_array),
    "fp16_compress_hook": Case(several_buckets=True, hook=comm_hooks.fp16_compress_hook,
                               bound=fp16_bound),
    "bf16_compress_hook": Case(several_buckets=True, hook=comm_hooks.bf16_compress_hook,
                               bound=bf16_bound),
    "fp16_compress_wrapper": Case(several_buckets=True, bound=fp16_wrapper_bound,
                                  hook=comm_hooks.fp16_compress_wrapper(comm_hooks.allreduce_hook)),
    "bf16_compress_wrapper": Case(several_buckets=True, bound=bf16_wrapper_bound,
                                  hook=comm_hooks.bf16_compress_wrapper(comm_hooks.allreduce_hook)),
    "sparse_embedding": Case(sparse=True),
    "sparse_embedding_allreduce_hook": Case(sparse=True, hook=comm_hooks.allreduce_hook),
}
PRESET_GRAD = 0.25  # dead.weight's gradient before training: globally unused, it must stay


def make_model(case, seed, reference=False):
    hg.manual_seed(seed)
    return (Bag(sparse=not reference) if case.sparse else Net(case.heads)).double()


def batch(step, size, integer=False):
    """The whole batch of one step (all ranks' shards), the same on every rank."""
    rng = np.random.default_rng([step, size])
    n = size * PER_RANK
    x = rng.integers(0, VOCAB, n) if integer else rng.standard_normal((n, IN))
    return x, rng.standard_normal((n, OUT))


def rows(ranks):
    return np.concatenate([np.arange(r * PER_RANK, (r + 1) * PER_RANK) for r in ranks])


def forward_kwargs(case, rank):
    return {"use_head": True} if case.heads and rank == 0 else {}


def mse(out, y):
    return ((out - hg.tensor(y)) ** 2).mean()


def ddp_step(ddp, x, y, micro=1, kwargs=None):
    """Forward/backward of this rank's shard in ``micro`` equal parts, all but the last under
    no_sync; each part's loss is scaled by 1/micro so that they add up to the shard's mean."""
    for j, part in enumerate(np.split(np.arange(len(x)), micro)):
        with ddp.no_sync() if j < micro - 1 else contextlib.nullcontext():
            (mse(ddp(hg.tensor(x[part]), **(kwargs or {})), y[part]) * (1.0 / micro)).backward()


def reference_grads(ref, x, y, shards):
    """Gradients on ``ref`` of sum over ``shards`` (ranks, weight, forward kwargs) of weight times
    the sum of those ranks' mean losses: one forward over their rows together, so with all ranks
    and weight 1/N this is the plain full-batch mean."""
    for p in ref.parameters():
        p.grad = None
    loss = 0.0
    for ranks, weight, kwargs in shards:
        if ranks:
            r = rows(ranks)
            loss = loss + mse(ref(hg.tensor(x[r]), **kwargs), y[r]) * (weight * len(ranks))
    loss.backward()
    return {name: None if p.grad is None else p.grad.array.copy()
            for name, p in ref.named_parameters()}


def case_shards(case, ranks, weight):
    """``reference_grads`` shards for these ranks: with heads, rank 0's forward uses ``head``."""
    if not case.heads:
        return [(list(ranks), weight, {})]
    return [([0] if 0 in ranks else [], weight, {"use_head": True}),
            ([r for r in ranks if r != 0], weight, {})]


def dense(grad):
    return grad.to_dense().array if grad.is_sparse else grad.array


def sgd(params, keep=()):
    for name, p in params.items():
        if p.grad is not None and name not in keep:
            p.array -= LR * dense(p.grad)


def zero_grads(params, in_place=False, keep=()):
    """None, or zeros in place (gradient_as_bucket_view: .grad stays the bucket view)."""
    for name, p in params.items():
        if p.grad is None or name in keep:
            continue
        if in_place and not p.grad.is_sparse:
            p.grad.array[...] = 0
        else:
            p.grad = None


def assert_same_on_all_ranks(group, arrays, what):
    """Bit-identical on every rank (the MPI results every rank trains on must agree exactly)."""
    everyone = group.comm.allgather({k: np.asarray(v) for k, v in arrays.items()})
    for rank, theirs in enumerate(everyone):
        for name, value in theirs.items():
            assert np.array_equal(value, everyone[0][name]), \
                f"{what} {name} differs between rank {rank} and rank 0"


def assert_close(got, want, tol, what):
    err = np.max(np.abs(got - want), initial=0.0)
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def assert_is_bucket_view(reducer, name, grad):
    """``grad`` is the parameter's view into its bucket's flat buffer, not a copy."""
    bucket_index, k = reducer.locators[reducer.names.index(name)]
    bucket = reducer.buckets[bucket_index]
    assert np.shares_memory(grad, bucket.contents), f"{name}: .grad is not in its bucket"
    start = bucket.contents.ctypes.data + int(bucket.offsets[k]) * bucket.contents.itemsize
    assert grad.ctypes.data == start and grad.shape == reducer.params[
        reducer.names.index(name)].shape, f"{name}: .grad is not its own bucket view"


# --- the one training comparison, per mode --------------------------------------------------
def setup(case, group, monkeypatch):
    """DDP over a model initialised from this rank's seed, and the reference from rank 0's.

    Returns the DDP module and the {name: parameter} dicts of both models."""
    options = dict(case.ddp)
    if case.several_buckets:
        monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", FIRST_BUCKET_BYTES)
        options["bucket_cap_mb"] = BUCKET_CAP_MB
    model, ref = make_model(case, seed=group.rank()), make_model(case, seed=0, reference=True)
    ddp = DDP(model, process_group=group, **options)  # every rank starts from rank 0's values
    if case.hook is not None:
        ddp.register_comm_hook(group, case.hook)
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in params.items():
        assert np.array_equal(p.array, ref_params[name].array), f"{name} is not rank 0's"
    if case.several_buckets:
        assert len(ddp.reducer.buckets) >= 3, ddp.reducer.bucket_indices()
    return ddp, params, ref, ref_params


def run_case(case, group, monkeypatch):
    rank, size = group.rank(), group.size()
    ddp, params, ref, ref_params = setup(case, group, monkeypatch)
    reducer = ddp.reducer
    preset = {}
    if case.heads:  # dead.weight holds a gradient from before, dead.bias none: both must stay
        preset["dead.weight"] = np.full(params["dead.weight"].shape, PRESET_GRAD)
        params["dead.weight"].grad = hg.tensor(preset["dead.weight"].copy())

    for step in range(STEPS):
        x, y = batch(step, size, integer=case.sparse)
        mine = rows([rank])
        ddp_step(ddp, x[mine], y[mine], case.micro, forward_kwargs(case, rank))
        # The order the buckets are rebuilt from: static_graph records it in its second step.
        if step == (1 if case.ddp.get("static_graph") else 0):
            first_order = [list(reducer.ready_order)]
            dist.broadcast_object_list(first_order, src=0, group=group)
            assert not reducer.has_rebuilt_buckets
        spread = None
        if case.bound is not None:  # the error of one step, at DDP's own parameters
            for name, p in ref_params.items():
                p.array[...] = params[name].array
            spread = shard_spread(case, ref, x, y, size)
        want = reference_grads(ref, x, y, case_shards(case, range(size), 1 / size))
        check_gradients(case, group, reducer, params, want, spread, preset)
        sgd(params, keep=preset)
        sgd(ref_params)
        zero_grads(params, in_place=case.view, keep=preset)

    if case.bound is None:
        for name, p in params.items():
            assert_close(p.array, ref_params[name].array, EXACT,
                         f"parameter {name} after {STEPS} steps")
    assert_same_on_all_ranks(group, {n: p.array for n, p in params.items()}, "parameter")
    check_rebuilt(case, group, reducer, first_order[0])


def shard_spread(case, ref, x, y, size):
    """S = sum_r |g_r| / N per parameter, g_r the gradient of rank r's mean loss alone."""
    spread = {}
    for r in range(size):
        for name, g in reference_grads(ref, x, y, [([r], 1.0, forward_kwargs(case, r))]).items():
            spread[name] = spread.get(name, 0.0) + np.abs(g) / size
    return spread


def check_gradients(case, group, reducer, params, want, spread, preset):
    if case.bound is not None:
        factor, floor = case.bound(group.size())
    for name, p in params.items():
        if name in preset:  # globally unused: untouched (as a view: the same values)
            assert_close(p.grad.array, preset[name], EXACT if case.view else 0.0, f"unused {name}")
        elif want[name] is None:
            assert p.grad is None, f"globally unused {name} got a gradient"
            continue
        else:
            tol = EXACT if case.bound is None else factor * spread[name] + floor
            err = np.abs(dense(p.grad) - want[name])
            assert np.all(err <= tol), f"{name}: error {err.max():.3g} over the bound"
        if case.sparse and name == "emb.weight":
            assert p.grad.is_sparse, "the embedding's reduced gradient should stay sparse"
        elif case.view:
            assert_is_bucket_view(reducer, name, p.grad.array)
    assert_same_on_all_ranks(group, {n: dense(p.grad) for n, p in params.items()
                                     if p.grad is not None}, "gradient")


def check_rebuilt(case, group, reducer, first_order):
    """After the first step, the buckets follow rank 0's observed ready order, on every rank."""
    assert_same_on_all_ranks(group, {"layout": str(reducer.bucket_indices())}, "bucket")
    if case.ddp.get("find_unused_parameters"):
        assert not reducer.has_rebuilt_buckets  # as the seed: never with unused-parameter search
        return
    assert reducer.has_rebuilt_buckets
    assert sorted(first_order) == list(range(len(reducer.params)))
    limits = [FIRST_BUCKET_BYTES if case.several_buckets else buckets.DEFAULT_FIRST_BUCKET_BYTES,
              reducer.bucket_bytes_cap]
    assert reducer.bucket_indices() == buckets.compute_bucket_assignment_by_size(
        [reducer.params[i] for i in first_order], limits, reducer.expect_sparse, first_order)
    if not case.sparse:  # one dtype, no bucket of its own: the buckets cut the order in pieces
        assert [i for b in reducer.bucket_indices() for i in b] == first_order
    if case.several_buckets:
        assert len(reducer.buckets) >= 3


@mpi
@pytest.mark.parametrize("mode", MODES)
def test_matches_full_batch_training(group, monkeypatch, mode):
    if mode == "bf16_compress_wrapper":
        pytest.importorskip("ml_dtypes")  # numpy's bfloat16 dtype (the test extra has it)
    run_case(MODES[mode], group, monkeypatch)


# --- uneven inputs ---------------------------------------------------------------------------
@mpi
@pytest.mark.parametrize("mode, divide_by_initial_world_size", [
    ("default", True), ("default", False), ("several_buckets", True),
    ("find_unused_parameters", True), ("allreduce_hook", True), ("sparse_embedding", True),
    ("sparse_embedding_allreduce_hook", True)])
def test_join_with_uneven_inputs(group, monkeypatch, mode, divide_by_initial_world_size):
    """Rank r has 2 + r batches (rank 0 runs out first), then everybody one more step outside
    join(). The reference applies each iteration's average over the active ranks' shards, divided
    by the world size or by the number of active ranks; all ranks end with its parameters."""
    case = MODES[mode]
    rank, size = group.rank(), group.size()
    counts = [2 + r for r in range(size)]
    ddp, params, ref, ref_params = setup(case, group, monkeypatch)

    def train(step):
        x, y = batch(step, size, integer=case.sparse)
        ddp_step(ddp, x[rows([rank])], y[rows([rank])], kwargs=forward_kwargs(case, rank))
        sgd(params)
        zero_grads(params)

    with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for step in range(counts[rank]):
            train(step)
    train(max(counts))  # even again: the divisor is the world size

    for step in range(max(counts) + 1):
        active = [r for r in range(size) if counts[r] > step or step == max(counts)]
        divisor = size if divide_by_initial_world_size else len(active)
        reference_grads(ref, *batch(step, size, integer=case.sparse),
                        case_shards(case, active, 1 / divisor))
        sgd(ref_params)
    for name, p in params.items():
        assert_close(p.array, ref_params[name].array, EXACT, f"parameter {name}")
    assert_same_on_all_ranks(group, {n: p.array for n, p in params.items()}, "parameter")


# --- construction ---------------------------------------------------------------------------
@mpi
def test_construction_broadcasts_parameters_and_buffers(group):
    """Models initialised differently per rank all start from rank 0's parameters and buffers,
    frozen parameters included."""
    rank = group.rank()
    model = make_model(MODES["default"], seed=rank)
    model.frozen = nn.Linear(2, 2).double().requires_grad_(False)
    model.register_buffer("scale", hg.tensor(np.full(3, float(rank))))
    DDP(model, process_group=group)
    state = {name: t.array for name, t in model.state_dict(keep_vars=True).items()}
    assert_same_on_all_ranks(group, state, "state")
    reference = make_model(MODES["default"], seed=0)
    for name, p in reference.named_parameters():
        assert np.array_equal(state[name], p.array)
    assert not state["scale"].any()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("change, message", [
    ("shape", r"rank 1 has parameter mid\.weight \[7, 6\] float64 where rank 0 has "
              r"mid\.weight \[6, 6\] float64"),
    ("extra", r"rank 1 has parameter extra\.weight \[2, 2\] float64 that rank 0 does not have"),
    ("missing", r"rank 1 lacks parameter mid2\.bias \[6\] float64 of rank 0"),
])
def test_different_models_across_ranks_fail_on_every_rank(group, change, message):
    model = make_model(MODES["default"], seed=0)
    if group.rank() == 1:
        if change == "shape":
            model.mid = nn.Linear(HID, HID + 1).double()
        elif change == "extra":
            model.extra = nn.Linear(2, 2).double()
        else:
            model.mid2.bias = None
    with pytest.raises(ValueError, match=message):
        DDP(model, process_group=group)


@mpi
def test_static_graph_that_changes_raises(group):
    """test_invalid_static_graph: a parameter unused in the first iteration and used later makes
    its hook fire more often than recorded (Note [Static graph])."""
    case = MODES["static_graph_unused"]
    ddp = DDP(make_model(case, 0), process_group=group, static_graph=True)
    x, y = batch(0, group.size())
    mine = rows([group.rank()])
    ddp_step(ddp, x[mine], y[mine])  # head unused everywhere: recorded as unused
    assert ddp._get_ddp_logging_data()["static_graph"]
    assert ddp.reducer.static_unused == sorted(
        ddp.reducer.names.index(n) for n in ("head.weight", "head.bias", "dead.weight",
                                             "dead.bias"))
    with pytest.raises(RuntimeError, match="Your training graph has changed in this iteration"):
        ddp_step(ddp, x[mine], y[mine], kwargs={"use_head": True})


def test_set_static_graph_before_the_first_forward():
    ddp = DDP(make_model(MODES["default"], 0))
    ddp._set_static_graph()
    assert ddp.static_graph and ddp.reducer.static_graph
    with pytest.warns(UserWarning, match="no need to set it again"):
        ddp._set_static_graph()
    with pytest.warns(UserWarning, match="static_graph=True will detect unused parameters"):
        DDP(make_model(MODES["default"], 0), static_graph=True, find_unused_parameters=True)


def test_module_without_trainable_parameters():
    model = make_model(MODES["default"], 0).requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        DDP(model)


def test_comm_hook_registered_twice():
    ddp = DDP(make_model(MODES["default"], 0))
    ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook "
                                           "can only be called once"):
        ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)


def test_compressing_comm_hooks_refuse_sparse_buckets():
    bucket = type("SparseBucket", (), {"is_sparse": lambda self: True})()
    for hook in (comm_hooks.fp16_compress_hook, comm_hooks.bf16_compress_hook):
        with pytest.raises(NotImplementedError, match="use allreduce_hook"):
            hook(None, bucket)


# --- misuse during training -------------------------------------------------------------------
def _shard(group, step=0):
    x, y = batch(step, group.size())
    return x[rows([group.rank()])], y[rows([group.rank()])]


@mpi
def test_unused_parameters_without_detection_fail_at_the_next_forward(group):
    ddp = DDP(make_model(MODES["find_unused_parameters"], seed=0), process_group=group)
    x, y = _shard(group)
    ddp_step(ddp, x, y)  # head and dead get no gradient: their bucket never completes
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior "
                                           "iteration before starting a new one") as error:
        ddp(hg.tensor(x))
    message = str(error.value)
    assert "find_unused_parameters=True" in message
    names = message[message.index("did not receive"):]
    for name in ("head.weight", "head.bias", "dead.weight", "dead.bias"):
        assert name in names
    assert "mid.weight" not in names and "out.bias" not in names


@pytest.fixture
def several_buckets(monkeypatch):
    """Net(heads=True) in buckets [[dead.bias], [mid2.bias .. dead.weight], ..., [out.weight]]."""
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", FIRST_BUCKET_BYTES)
    return {"bucket_cap_mb": BUCKET_CAP_MB}


@mpi
def test_marking_a_variable_ready_twice(group, several_buckets):
    ddp = DDP(make_model(MODES["find_unused_parameters"], seed=0), process_group=group,
              **several_buckets)
    x, _ = _shard(group)
    ddp(hg.tensor(x))
    index = ddp.reducer.names.index("out.weight")  # alone in the last bucket: nothing launches
    assert ddp.reducer.bucket_indices()[-1] == [index]
    ddp.reducer.autograd_hook(index)
    with pytest.raises(RuntimeError, match=r"Expected to mark a variable ready only once\. .*"
                                           r"Parameter at index 0 with name out\.weight has "
                                           r"been marked as ready twice"):
        ddp.reducer.autograd_hook(index)


@mpi
def test_second_backward_through_one_forward(group, several_buckets):
    """The first backward leaves head/dead's buckets pending (no finalize), so the second one
    marks parameters whose buckets are complete already."""
    ddp = DDP(make_model(MODES["find_unused_parameters"], seed=0), process_group=group,
              **several_buckets)
    assert ddp.reducer.bucket_indices()[0] == [ddp.reducer.names.index("dead.bias")]
    x, y = _shard(group)
    loss = mse(ddp(hg.tensor(x)), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="Expected to mark a variable ready only once"):
        loss.backward()


@mpi
def test_a_dropped_ddp_lets_go_of_the_model(group, several_buckets):
    """As the seed's ~Reducer: a DDP that failed mid-iteration and was dropped no longer hooks
    the model, so a new DDP over it trains normally, without waiting for the cyclic collector."""
    case = MODES["default"]
    model = make_model(case, seed=0)
    ddp = DDP(model, process_group=group, **several_buckets)
    x, y = _shard(group)
    gc.disable()
    try:
        ddp(hg.tensor(x))
        ddp.reducer.autograd_hook(ddp.reducer.names.index("out.weight"))  # left half done
        del ddp
        ddp_step(DDP(model, process_group=group), x, y)
    finally:
        gc.enable()
    size = group.size()
    want = reference_grads(make_model(case, seed=0, reference=True), *batch(0, size),
                           case_shards(case, range(size), 1 / size))
    for name, p in model.named_parameters():
        assert_close(p.grad.array, want[name], EXACT, f"gradient {name}")


@mpi
def test_rebuild_waits_for_a_complete_ready_order(group):
    """A forward without backward first (no ready order yet) postpones the rebuild, as the seed."""
    ddp = DDP(make_model(MODES["default"], seed=0), process_group=group)
    x, y = _shard(group)
    ddp(hg.tensor(x))
    ddp_step(ddp, x, y)
    assert not ddp.reducer.has_rebuilt_buckets
    ddp_step(ddp, x, y)
    assert ddp.reducer.has_rebuilt_buckets


# --- bfloat16 compression ---------------------------------------------------------------------
def test_bfloat16_rounding_matches_torch():
    """Round to nearest even, infinities kept, NaN stays NaN (never rounds into -0 or inf)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3895314e38, 1e-40,
                        1.00390625, 1.01171875, -1.00390625], np.float32)  # ties, max, subnormal
    nan_payloads = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00001, 0x7F800001],
                            np.uint32).view(np.float32)
    x = np.concatenate([special, nan_payloads, rng.standard_normal(10000).astype(np.float32),
                        (rng.standard_normal(1000) * 1e30).astype(np.float32)])
    ours = comm_hooks._from_bfloat16_bits(comm_hooks._to_bfloat16_bits(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours, theirs)  # equal_nan: NaN matches NaN
