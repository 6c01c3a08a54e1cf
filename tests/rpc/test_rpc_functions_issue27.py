"""rpc.functions.async_execution as PyTorch's (issue 27): the callee replies when the returned
Future completes, holding no serving thread meanwhile, and a graceful shutdown waits for it.

Functions and classes live at module level: every rank imports this module under the same name.
The last test is PyTorch's distributed/rpc/batch/parameter_server.py pattern, checked against
the same rounds computed by hand.
"""

import threading

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc
from hpcgrad import optim
from hpcgrad.futures import Future, wait_all

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


# --- remote functions (PyTorch's rpc_test.py ones, with hpcgrad) --------------------------------
@rpc.functions.async_execution
def async_add_chained(to, x, y, z):
    return rpc.rpc_async(to, cases.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_add_with_future_ctor(to, x, y, z):
    fut = Future()
    rpc.rpc_async(to, cases.add, args=(x, y)).then(lambda fut1: fut.set_result(fut1.wait() + z))
    return fut


@rpc.functions.async_execution
def async_add_chained_multi(to, x, num, step):
    fut = rpc.rpc_async(to, cases.add, args=(x, 0))
    for _ in range(num):
        fut = fut.then(lambda fut: fut.wait() + step)
    return fut


@rpc.functions.async_execution
def async_add_nested(to, x, y, z):
    return rpc.rpc_async(to, async_add_chained, args=(to, x, y, 0)).then(
        lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_wrong_type():
    return hg.zeros(2, 2)


@rpc.functions.async_execution
def async_raise_func():
    raise RuntimeError("Expected error")


@rpc.functions.async_execution
def async_fail_later(text):
    fut = Future()
    fut.set_exception(ValueError(text))
    return fut


class AsyncExecutionClass:
    """PyTorch's: async_execution is the inner decorator of staticmethod/classmethod."""

    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, cases.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = Future()
        rpc.rpc_async(to, cases.add, args=(x, y)).then(
            lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut

    @rpc.functions.async_execution
    def bound_async_add(self, to, x, y, z):
        return rpc.rpc_async(to, cases.add, args=(x, y)).then(lambda fut: fut.wait() + z)


# A gate: async calls that wait on it return at once; open_gate completes them all.
_gate = {"future": Future(), "arrived": 0}
_gate_lock = threading.Lock()


@rpc.functions.async_execution
def wait_at_gate(i):
    with _gate_lock:
        _gate["arrived"] += 1
        return _gate["future"].then(lambda fut: fut.wait() + i)


def open_gate(value):
    with _gate_lock:
        arrived, fut = _gate["arrived"], _gate["future"]
        _gate["future"], _gate["arrived"] = Future(), 0
    fut.set_result(value)
    return arrived


@rpc.functions.async_execution
def completed_later(value, seconds):
    """A Future completed by a timer thread: nobody on this rank works on it meanwhile."""
    fut = Future()
    threading.Timer(seconds, fut.set_result, args=(value,)).start()
    return fut


def ones():
    return hg.ones(2, 2)


def peers():
    rank, size = rank_and_size()
    return (rank + 1) % size, (rank + 2) % size


# --- tests ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_async_functions_reply_with_their_futures_value():
    """Every rank calls its next peer, which calls the one after (itself at 2 ranks)."""
    dst1, dst2 = peers()
    x = ones()
    expected = np.full((2, 2), 3.0)
    assert np.array_equal(rpc.rpc_sync(dst1, async_add_chained, args=(dst2, x, 1, 1)).array,
                          expected)
    assert np.array_equal(
        rpc.rpc_async(dst1, async_add_with_future_ctor, args=(dst2, x, 1, 1)).wait(WAIT_LIMIT)
        .array, expected)
    assert np.array_equal(rpc.remote(dst1, async_add_chained, args=(dst2, x, 1, 1))
                          .to_here().array, expected)
    assert np.array_equal(rpc.rpc_sync(dst1, async_add_chained_multi, args=(dst2, x, 5, 2)).array,
                          np.full((2, 2), 11.0))
    assert np.array_equal(rpc.rpc_sync(dst1, async_add_nested, args=(dst2, x, 1, 2)).array,
                          np.full((2, 2), 4.0))
    # called locally, the decorated function is the function: it returns its Future
    assert np.array_equal(async_add_chained(dst2, x, 1, 1).wait(WAIT_LIMIT).array, expected)


@pytest.mark.mpi(min_size=2)
def test_static_class_and_bound_async_methods():
    """PyTorch's decorator order; also through RRef proxies (the owner reads the mark)."""
    dst1, dst2 = peers()
    x = ones()
    expected = np.full((2, 2), 4.0)
    for method in (AsyncExecutionClass.static_async_add, AsyncExecutionClass.class_async_add):
        assert np.array_equal(rpc.rpc_sync(dst1, method, args=(dst2, x, 1, 2)).array, expected)
    rref = rpc.remote(dst1, AsyncExecutionClass)
    for name in ("static_async_add", "class_async_add", "bound_async_add"):
        args = (dst2, x, 1, 2)
        assert np.array_equal(getattr(rref.rpc_sync(), name)(*args).array, expected)
        assert np.array_equal(getattr(rref.rpc_async(), name)(*args).wait(WAIT_LIMIT).array,
                              expected)
        assert np.array_equal(getattr(rref.remote(), name)(*args).to_here().array, expected)


@pytest.mark.mpi(min_size=2)
def test_async_errors_surface_at_the_caller():
    dst1, _ = peers()
    with pytest.raises(RuntimeError, match=r"Async functions must return an IValue of Future type, "
                                           r"but got Tensor: async_wrong_type is decorated"):
        rpc.rpc_sync(dst1, async_wrong_type)
    with pytest.raises(RuntimeError, match="Expected error"):
        rpc.rpc_sync(dst1, async_raise_func)
    with pytest.raises(ValueError, match=r"ValueError on worker\d \(rank \d\): failed later"):
        rpc.rpc_sync(dst1, async_fail_later, args=("failed later",))
    failed = rpc.remote(dst1, async_fail_later, args=("kept in the RRef",))
    with pytest.raises(ValueError, match="kept in the RRef"):
        failed.to_here()


@pytest.mark.mpi(min_size=2)
def test_waiting_async_calls_hold_no_serving_thread():
    """Rank 0 parks 3x as many async calls on rank 1 as rank 1 has serving threads (8), then
    opens their gate with one more call: blocking calls would take every thread and the gate
    call would never run (the test would fail on WAIT_LIMIT)."""
    rank, _ = rank_and_size()
    if rank != 0:
        return
    waiting = [rpc.rpc_async(1, wait_at_gate, args=(i,)) for i in range(24)]
    waiting += [rpc.remote(1, wait_at_gate, args=(100,))]
    arrived = 0
    while arrived < 25:  # every call has reached rank 1 (each returned its future at once)
        arrived = rpc.rpc_sync(1, lambda_free_arrived, timeout=WAIT_LIMIT)
    assert rpc.rpc_sync(1, open_gate, args=(1000,), timeout=WAIT_LIMIT) == 25
    assert wait_all(waiting[:-1], timeout=WAIT_LIMIT) == [1000 + i for i in range(24)]
    assert waiting[-1].to_here() == 1100


def lambda_free_arrived():
    with _gate_lock:
        return _gate["arrived"]


@pytest.mark.mpi(min_size=2)
def test_graceful_shutdown_waits_for_an_async_reply():
    """The quiet-shutdown wait (Note [Quiet shutdown]) returns only once the reply that rank 1's
    async function owes has arrived: its Future is completed by a timer thread after every rank
    is already waiting, so nothing else is in flight or being served meanwhile."""
    rank, _ = rank_and_size()
    fut = rpc.rpc_async(1, completed_later, args=("late", 0.3)) if rank == 0 else None
    rpc._require_agent().quiesce(WAIT_LIMIT)  # what rpc.shutdown(graceful=True) waits for
    if rank == 0:
        assert fut.done(), "shutdown's wait returned before the async reply arrived"
        assert fut.wait() == "late"


# --- PyTorch's distributed/rpc/batch/parameter_server.py ------------------------------------------
BATCH_ROUNDS = 2
LR, MOMENTUM = 0.05, 0.9


class BatchUpdateParameterServer:
    """The example's, with a 4 -> 3 Linear for resnet50 and one update per round of every
    trainer. The gradients are summed under the lock (the example sums outside it: with torch
    that is one atomic kernel call; here it is a Python-level read-modify-write)."""

    def __init__(self, batch_update_size):
        self.model = seeded_model()
        self.lock = threading.Lock()
        self.future_model = Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        for p in self.model.parameters():
            p.grad = hg.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)  # replies to every trainer of this round
                self.future_model = Future()
        return fut


def seeded_model():
    rng = np.random.default_rng(27)
    model = hg.nn.Linear(4, 3).double()
    model.weight.array[...] = rng.standard_normal((3, 4))
    model.bias.array[...] = rng.standard_normal(3)
    return model


def batch(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return rng.standard_normal((5, 4)), rng.standard_normal((5, 3))


def run_trainer(ps_rref):
    rank, _ = rank_and_size()
    loss_fn = hg.nn.MSELoss()
    m = ps_rref.rpc_sync().get_model()
    for step in range(BATCH_ROUNDS):
        inputs, labels = batch(rank, step)
        loss_fn(m(hg.tensor(inputs)), hg.tensor(labels)).backward()
        m = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                         args=(ps_rref, [p.grad for p in m.parameters()]))
    return step + 1


@pytest.mark.mpi(min_size=2)
def test_batch_parameter_server_example():
    """Rank 0 is the parameter server, every other rank a trainer (3 at 4 ranks); each round
    the server completes one Future for all trainers once the last gradient is in."""
    rank, size = rank_and_size()
    if rank != 0:
        return
    trainers = list(range(1, size))
    ps_rref = rpc.RRef(BatchUpdateParameterServer(len(trainers)))
    futs = [rpc.rpc_async(t, run_trainer, args=(ps_rref,)) for t in trainers]
    assert wait_all(futs, timeout=WAIT_LIMIT) == [BATCH_ROUNDS] * len(trainers)
    # the same rounds by hand: every trainer's MSE gradient at the same model, averaged, then
    # SGD with momentum (PyTorch's: the first step's buffer is the gradient itself)
    model = seeded_model()
    weight, bias = model.weight.array.copy(), model.bias.array.copy()
    buf_w = buf_b = None
    for step in range(BATCH_ROUNDS):
        grad_w, grad_b = np.zeros_like(weight), np.zeros_like(bias)
        for t in trainers:
            inputs, labels = batch(t, step)
            d_out = 2 * (inputs @ weight.T + bias - labels) / labels.size
            grad_w += d_out.T @ inputs
            grad_b += d_out.sum(axis=0)
        grad_w, grad_b = grad_w / len(trainers), grad_b / len(trainers)
        buf_w = grad_w if buf_w is None else MOMENTUM * buf_w + grad_w
        buf_b = grad_b if buf_b is None else MOMENTUM * buf_b + grad_b
        weight -= LR * buf_w
        bias -= LR * buf_b
    served = ps_rref.local_value().model
    np.testing.assert_allclose(served.weight.array, weight, rtol=1e-12)
    np.testing.assert_allclose(served.bias.array, bias, rtol=1e-12)


# --- PyTorch's error phrases (what users paste into a search box), then ours -------------------
def test_init_rpc_twice_is_already_initialized():
    with pytest.raises(RuntimeError, match=r"^RPC is already initialized: init_rpc was already "
                                           r"called on this rank \(as 'worker\d'\); call "
                                           r"shutdown\(\) first"):
        rpc.init_rpc("again")


def test_unknown_destination_worker():
    _, size = rank_and_size()
    with pytest.raises(RuntimeError, match=r"^Unknown destination worker WorkerUnknown: could not "
                                           r"find destination: unknown worker 'WorkerUnknown'"):
        rpc.get_worker_info("WorkerUnknown")
    with pytest.raises(RuntimeError, match=r"^Unknown destination worker nobody: "):
        rpc.rpc_sync("nobody", cases.add, args=(1, 2))
    with pytest.raises(RuntimeError, match=rf"^Unknown destination worker {size + 1}: could not "
                                           rf"find destination: no worker with rank {size + 1}"):
        rpc.rpc_async(size + 1, cases.add, args=(1, 2))


@pytest.mark.mpi(min_size=2)
def test_local_value_on_a_user_says_call_it_on_owner():
    rank, size = rank_and_size()
    peer = (rank + 1) % size
    rref = rpc.remote(peer, cases.add, args=(1, 2))
    with pytest.raises(RuntimeError, match=(
            rf"can't call localValue\(\) on user WorkerInfo\(id={rank}, name=worker{rank}\)\. "
            rf"Call it on owner WorkerInfo\(id={peer}, name=worker{peer}\): local_value\(\) on "
            rf"rank {rank}: this RRef is owned by rank {peer}; use to_here\(\)")):
        rref.local_value()
    assert rref.to_here() == 3


@pytest.mark.mpi(min_size=2)
def test_a_timed_out_rpc_ran_for_more_than_set_timeout():
    peer = (rank_and_size()[0] + 1) % rank_and_size()[1]
    with pytest.raises(rpc.RpcTimeoutError, match=r"^RPC ran for more than set timeout \(0\.001 "
                                                  r"ms\) and will now be marked with an error: "
                                                  r"RPC add to worker\d \(rank \d\) timed out "
                                                  r"after 1e-06 s"):
        rpc.rpc_sync(peer, cases.add, args=(1, 2), timeout=1e-6)


def test_worker_names_as_pytorch_workerinfo():
    """Checked on the gathered names, so every rank raises (a bad name on rank 0 only here)."""
    from hpcgrad.comm.mpi import comm_world
    from hpcgrad.distributed.rpc.agent import MPIRpcAgent
    rank, _ = rank_and_size()
    for bad in ("abc*", " ", "", "a" * 500):
        with pytest.raises(RuntimeError, match=r"^Worker name must match \^\[A-Za-z0-9-_:\]\*\$, "
                                               r"and must be non-empty and shorter than 128 "
                                               r"chars, but got "):
            MPIRpcAgent(bad if rank == 0 else f"fine{rank}", comm_world(), 1)
