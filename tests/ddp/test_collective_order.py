"""DDP posts its collectives in one order on every rank, when buckets wait for host copies or a comm thread.

Note [Sparse gathers in the group's order] (hpcgrad/collectives/sparse_reduce.py): a sparse
bucket's gather and the used-parameter map's all-reduce must not overtake earlier buckets'
all-reduces. Two roads can post those late, and both are driven here without a GPU:

- "staged" (MPI not CUDA-aware): a full GPU bucket's all-reduce waits for its host copy and is
  launched by a later hook, at a moment that differs per rank. Stand-in copies (host memory,
  ``ready()`` chosen per rank) take the place of the pinned ones; the single-process tests read
  the order of calls, the 2-rank one runs real MPI with the copies done on rank 0 only, where an
  overtaking call would match another rank's different collective (wrong sums, or a timeout).
- "thread" (HPCGRAD_DEVICE_COLLECTIVES=thread sends host arrays through the group's
  communication thread, Note [Device collectives per MPI]): rank 0's thread is slowed down, and
  every nonblocking MPI call on the group's communicators is recorded: none may bypass the thread.

Results are compared with single-process full-batch training (dense embedding gradient).
"""

import threading
import time
import types

import numpy as np
import pytest
from mpi4py import MPI

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import backend, nn
from hpcgrad.comm import buffers, device_path
from hpcgrad.ddp import buckets
from hpcgrad.ddp.reducer import Reducer
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.sparse import SparseCOOTensor

VOCAB, IN, HID, OUT = 11, 4, 6, 3
PER_RANK = 4
STEPS = 3  # the second and third run on buckets rebuilt from the first's ready order
LR = 0.1
TOL = 2e-5  # float32 (so that the used map, int32, shares a communicator with the buckets)


# --- stand-ins --------------------------------------------------------------------------------
class StandInCopy:
    """A bucket's host copy "in flight": ``ready()`` says what ``done()`` returns."""

    def __init__(self, array, done):
        self.array, self.host, self.done = array, np.array(array), done

    def ready(self):
        return self.done()

    def wait(self):
        return self.host

    def copy_back(self):
        self.array[...] = self.host

    def release(self, last_use=None):
        self.host = None


class RecordingGroup:
    """A process group of one rank that records each collective's name and dtype."""

    timeout = 5

    def __init__(self):
        self.log = []

    def size(self):
        return 1

    def rank(self):
        return 0

    def _done(self, name, array):
        self.log.append((name, np.dtype(array.dtype).name))
        return types.SimpleNamespace(wait=lambda: True)

    def iallreduce(self, array, op=None):
        return self._done("allreduce", array)

    def iallgather(self, output, array):
        output[0] = array
        return self._done("allgather", array)


@pytest.fixture
def staged(monkeypatch):
    """Bucket contents count as GPU arrays, MPI as not CUDA-aware; host copies never finish
    by themselves (a later hook finds them pending), so only a blocking launch starts them."""
    contents = {}  # id -> the array, held so that its id is not reused
    monkeypatch.setattr(backend, "is_gpu_array", lambda a: id(a) in contents)
    monkeypatch.setattr(buffers, "cuda_aware", lambda: False)
    monkeypatch.setattr(buffers, "stage_device_array",
                        lambda a: StandInCopy(a, done=lambda: False))
    return contents


def test_sparse_gather_follows_a_bucket_waiting_for_its_copy(staged):
    reducer = Reducer.__new__(Reducer)  # only the launch path
    dense = types.SimpleNamespace(contents=np.ones(4, np.float32), pending=0, expect_sparse=False,
                                  staged=None, work=None)
    staged[id(dense.contents)] = dense.contents
    grad = SparseCOOTensor(np.array([2]), np.ones((1, 3), np.float32), (5, 3))
    sparse = types.SimpleNamespace(expect_sparse=True, sparse_grad=grad, pending=0, work=None)
    group = RecordingGroup()
    reducer.__dict__.update(buckets=[dense, sparse], next_bucket=0, comm_hook=None, _copying=[],
                            process_group=group, _comm_start=None)
    reducer.mark_bucket_ready(0)
    # The dense bucket's all-reduce first, although its copy was not done: the gather (row
    # counts, then indices and values) must not go ahead of it on any rank.
    assert group.log == [("allreduce", "float32"), ("allgather", "int64"),
                         ("allgather", "int64"), ("allgather", "float32")]
    assert not reducer._copying
    result = sparse.work.result()
    assert result.indices.tolist() == [2] and result.values.tolist() == [[1, 1, 1]]


def test_used_map_follows_buckets_waiting_for_their_copies(staged, monkeypatch):
    params = [nn.Parameter(np.zeros(3, np.float32)),
              nn.Parameter(np.zeros(2, np.float32))]
    group = RecordingGroup()
    reducer = Reducer(params, [[0], [1]], group, find_unused_parameters=True)
    monkeypatch.setattr(reducer, "_queue_finalize", lambda: None)  # called below instead
    for bucket in reducer.buckets:
        staged[id(bucket.contents)] = bucket.contents
    reducer.prepare_for_backward()
    reducer.unused_parameters = [1]
    params[0].grad = hg.tensor(np.full(3, 2.0, np.float32))
    reducer.autograd_hook(0)
    assert group.log == []  # both buckets wait for their host copies: nothing posted yet
    reducer.finalize_backward()
    assert group.log == [("allreduce", "float32"), ("allreduce", "float32"),
                         ("allreduce", "int32")]  # the used map last, as on every rank
    assert params[0].grad.array.tolist() == [2, 2, 2] and params[1].grad is None


# --- the model, the reference, the 2-rank runs --------------------------------------------------
class Mixed(nn.Module):
    """Dense rows and embedding rows summed: with small buckets the embedding's sparse bucket
    sits between dense ones, and ``head`` (used by rank 0 only) makes the used map matter."""

    def __init__(self, sparse, head):
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.emb = nn.Embedding(VOCAB, HID, sparse=sparse)
        self.mid = nn.Linear(HID, HID)
        self.out = nn.Linear(HID, OUT)
        self.head = nn.Linear(HID, OUT) if head else None

    def forward(self, x, idx, use_head=False):
        h = self.mid((self.inp(x) + self.emb(idx)).tanh()).tanh()
        return self.out(h) + self.head(h) if use_head else self.out(h)


def make_model(seed, sparse, head):
    hg.manual_seed(seed)
    return Mixed(sparse, head)


def batch(step, size):
    rng = np.random.default_rng([step, size, 14])
    n = size * PER_RANK
    return (rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, VOCAB, n),
            rng.standard_normal((n, OUT)).astype(np.float32))


def mse(out, y):
    return ((out - hg.tensor(y)) ** 2).mean()


def dense(grad):
    return grad.to_dense().array if grad.is_sparse else grad.array


def train_and_compare(group, monkeypatch, unused):
    """STEPS of DDP on the rank's shard against the full-batch reference, every gradient
    compared; returns the DDP module."""
    rank, size = group.rank(), group.size()
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 100)  # several buckets
    model, ref = make_model(rank, True, unused), make_model(0, False, unused)
    ddp = DDP(model, process_group=group, bucket_cap_mb=150 / 2 ** 20,
              find_unused_parameters=unused)
    kinds = ["sparse" if b.expect_sparse else "dense" for b in ddp.reducer.buckets]
    assert "sparse" in kinds[:-1] and kinds.count("dense") >= 2, kinds
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for step in range(STEPS):
        x, idx, y = batch(step, size)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        use_head = unused and rank == 0
        mse(ddp(hg.tensor(x[mine]), hg.tensor(idx[mine]), use_head=use_head), y[mine]).backward()
        for p in ref.parameters():
            p.grad = None
        loss = 0.0
        for r in range(size):  # each rank's mean loss, averaged: DDP's gradient
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            out = ref(hg.tensor(x[rows]), hg.tensor(idx[rows]), use_head=unused and r == 0)
            loss = loss + mse(out, y[rows]) * (1.0 / size)
        loss.backward()
        for name, p in params.items():
            want = ref_params[name].grad
            if want is None:  # head, when nobody used it
                assert p.grad is None, f"{name}.grad at step {step}"
                continue
            assert (p.grad is not None and p.grad.is_sparse) == (name == "emb.weight"), name
            np.testing.assert_allclose(dense(p.grad), want.array, rtol=0, atol=TOL,
                                       err_msg=f"{name}.grad at step {step}")
        for name, p in params.items():
            if p.grad is not None:
                p.array -= LR * dense(p.grad)
                ref_params[name].array -= LR * ref_params[name].grad.array
            p.grad = None
    return ddp


@pytest.fixture
def fresh_group():
    """A group made inside the test, after its environment is set (the road is chosen then)."""
    made = []

    def make():
        dist.init_process_group(timeout=30)
        made.append(dist.new_group(timeout=30))
        return made[-1]
    yield make
    for group in made:
        dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("unused", [False, True], ids=["sparse", "sparse_and_unused"])
def test_staged_buckets_launched_at_different_times_per_rank(fresh_group, monkeypatch, unused):
    """Rank 0 finds its copies done at once, the others only when they block (finalize, or a
    sparse bucket or the used map that must not overtake them)."""
    group = fresh_group()
    contents = {}  # id -> the array, held so that its id is not reused
    done_here = group.rank() == 0
    monkeypatch.setattr(backend, "is_gpu_array", lambda a: id(a) in contents)
    monkeypatch.setattr(buffers, "cuda_aware", lambda: False)

    def stage(array):
        return StandInCopy(array, done=lambda: done_here)

    monkeypatch.setattr(buffers, "stage_device_array", stage)
    original = Reducer.initialize_buckets

    def initialize_buckets(reducer, indices):
        original(reducer, indices)
        contents.update((id(b.contents), b.contents) for b in reducer.buckets
                        if not b.expect_sparse)

    monkeypatch.setattr(Reducer, "initialize_buckets", initialize_buckets)
    ddp = train_and_compare(group, monkeypatch, unused)
    assert ddp.reducer.has_rebuilt_buckets or unused


class RecordingComm(MPI.Intracomm):
    """The group's communicator, recording the nonblocking collectives posted on it."""

    calls = None  # [(name, thread name)], set per test

    def _record(self, name):
        self.calls.append((name, threading.current_thread().name))

    def Iallreduce(self, *args):
        # The default checks' fingerprints (Note [Checked collectives]: an array.array of two
        # int64, on a duplicate, which mpi4py makes of this class too) are host data on their
        # own communicator: they may go direct.
        spec = args[1] if len(args) > 1 else None
        if not (isinstance(spec, list) and type(spec[0]).__name__ == "array"):
            self._record("Iallreduce")
        return super().Iallreduce(*args)

    def Iallgather(self, *args):
        self._record("Iallgather")
        return super().Iallgather(*args)

    def Iallgatherv(self, *args):
        self._record("Iallgatherv")
        return super().Iallgatherv(*args)

    def Ibcast(self, *args):
        self._record("Ibcast")
        return super().Ibcast(*args)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("unused", [False, True], ids=["sparse", "sparse_and_unused"])
def test_thread_road_keeps_every_collective_on_the_thread(fresh_group, monkeypatch, unused):
    monkeypatch.setenv(device_path.ENV, "thread")
    group = fresh_group()
    assert group._via_thread is device_path._always
    RecordingComm.calls = []
    for attribute in ("comm", "_wide"):  # same communicators, recording handles
        setattr(group, attribute, RecordingComm(getattr(group, attribute)))
    submit = device_path.CommThread.submit
    slow = group.rank() == 0
    ran = []

    def late_submit(thread, call, args, device=-1):
        def late(*a):  # rank 0 posts each thread call late: a call overtaking it would show
            if slow:
                time.sleep(0.005)
            ran.append(call.__name__)
            return call(*a)
        return submit(thread, late, args, device)

    monkeypatch.setattr(device_path.CommThread, "submit", late_submit)
    train_and_compare(group, monkeypatch, unused)
    direct = [(name, thread) for name, thread in RecordingComm.calls]
    assert direct == [], f"nonblocking MPI calls that bypassed the communication thread: {direct}"
    assert "Allgather" in ran and "Allreduce" in ran, sorted(set(ran))
