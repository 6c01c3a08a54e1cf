"""Shared pieces of the PyTorch RPC and dist-autograd ports: fixtures, remote functions, checks.

PyTorch's rpc_test.py and dist_autograd_test.py run every test on every rank at once (world
size 4), each rank calling its ring peer ``(rank + 1) % world_size``; the ports keep that, so
they run at 2, 3 and 4 ranks. Functions called through RPC live here, at module level: every
rank imports this module under the same name (tests/conformance is on sys.path), so the callee
unpickles them by reference. Where PyTorch calls a torch builtin (torch.add, torch.stack, ...)
the ports call hpcgrad's (hg.add, hg.stack, ...), or a small stand-in defined here when hpcgrad
has none (cos, narrow, split, multi_dot). PyTorch's private graph accessors
(dist_autograd._retrieve_context, ctx._send_functions(), ...) are reached through
``retrieve_context``/``send_functions``/... below, which use hpcgrad's names.
"""

import concurrent.futures
import functools
import threading
import time
from enum import Enum

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad.autograd import Function, once_differentiable
from hpcgrad.comm.mpi import comm_world

WAIT = 20  # seconds any wait in these tests may last before it fails (never hang)


# --- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rpc_worker():
    """RPC on this rank for the whole module (init_rpc and shutdown are collective)."""
    rank = comm_world().Get_rank()
    rpc.init_rpc(worker_name(rank))
    yield rank
    rpc.shutdown(timeout=WAIT)


@pytest.fixture(autouse=True)
def rpc_step(rpc_worker):
    """Fresh per-test state (PyTorch starts new processes per test), and every rank enters and
    leaves a test together, so no test sees another's RPCs or flags."""
    reset_state()
    barrier()
    yield
    barrier()


def barrier():
    """Every rank gets here (requests keep being served meanwhile), within WAIT: dist.barrier()."""
    rpc._require_agent().join(WAIT)


def worker_name(rank):
    return f"worker{rank}"


def rank_and_size():
    return rpc.get_worker_info().id, comm_world().Get_size()


class Ring:
    """PyTorch's ``_next_rank``: the ranks after this one in turn, never this one."""

    def __init__(self):
        self.rank, self.size = rank_and_size()
        self.dst = None

    def next(self):
        self.dst = (self.rank if self.dst is None else self.dst) + 1
        self.dst %= self.size
        if self.dst == self.rank:
            return self.next()
        return self.dst


# --- PyTorch's rpc_done / ctx_ids flags: rank r+d tells rank r "my RPC to you is done" ------------
rpc_done = [False] * 4
ctx_ids = [-1] * 4
known_context_ids = set()
_flags = threading.Condition()


def reset_state():
    with _flags:
        rpc_done[:] = [False] * 4
        ctx_ids[:] = [-1] * 4
        known_context_ids.clear()
    SimulateBackwardError.simulate_error = True
    global value_future
    value_future = concurrent.futures.Future()


def set_rpc_done(ctx_id, rank_distance):
    with _flags:
        rpc_done[rank_distance] = True
        ctx_ids[rank_distance] = ctx_id
        known_context_ids.add(ctx_id)
        _flags.notify_all()


def check_rpc_done(rank_distance):
    """Wait (bounded) until the rank ``rank_distance`` before this one set its flag."""
    with _flags:
        if not _flags.wait_for(lambda: rpc_done[rank_distance], WAIT):
            raise TimeoutError(f"rank {rank_and_size()[0]}: no rpc_done[{rank_distance}] "
                               f"within {WAIT} s")


def tell_done(ctx_id, rank_distance):
    """``rpc_sync(worker(rank + rank_distance), _set_rpc_done, (ctx_id, rank_distance))``."""
    rank, size = rank_and_size()
    rpc.rpc_sync(worker_name((rank + rank_distance) % size), set_rpc_done,
                 args=(ctx_id, rank_distance), timeout=WAIT)


# --- contexts and their graphs, under PyTorch's private names ------------------------------------
def retrieve_context(context_id):
    return dist_autograd.container.retrieve(context_id)


def current_context():
    context_id = dist_autograd.current_context_id()
    if context_id is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap "
                           "your code using: `with torch.distributed.autograd.context() as "
                           "context_id` to generate a valid context")
    return retrieve_context(context_id)


def send_functions(ctx):
    """The context's SendRpcBackward nodes in the order their messages were made."""
    return [fn for _, fn in sorted(ctx.send_functions.items())]


def recv_functions(ctx):
    return [fn for _, fn in sorted(ctx.recv_functions.items())]


def all_contexts_cleaned_up(timeout=10):
    """PyTorch's ``_all_contexts_cleaned_up``: releases travel asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        left = set()
        for context_id in list(known_context_ids):
            try:
                retrieve_context(context_id)
                left.add(context_id)
            except RuntimeError:
                pass
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.01)


def next_names(node):
    return [None if fn is None else fn.name() for fn, _ in node.next_functions]


def verify_graph_for_first_rpc_call(send_function, recv_function, t1, t2, ret):
    """Caller: one SendRpcBackward -> (t1, t2) AccumulateGrads; ``ret`` comes from the recv."""
    next_funcs = send_function.next_functions
    assert len(next_funcs) == 2, next_names(send_function)
    for (fn, input_nr), t in zip(next_funcs, (t1, t2)):
        assert fn.name() == "AccumulateGrad" and input_nr == 0
        assert fn.variable is t
    assert ret.grad_fn is recv_function


def verify_graph_for_rpc_call_exec(send_function):
    """Callee of add(t1, t2): SendRpcBackward -> AddBackward -> one RecvRpcBackward (twice)."""
    next_funcs = send_function.next_functions
    assert len(next_funcs) == 1, next_names(send_function)
    add_backward = next_funcs[0][0]
    assert add_backward.name().startswith("AddBackward"), add_backward.name()
    next_funcs = add_backward.next_functions
    assert len(next_funcs) == 2
    assert [fn.name() for fn, _ in next_funcs] == ["RecvRpcBackward"] * 2
    assert next_funcs[0][0] is next_funcs[1][0], "t1 and t2 came in one message"


def verify_graph_for_nested_rpc_call(ctx):
    """A rank that forwards (t1, t2) on and the result back: two sends, each to one recv."""
    sends = send_functions(ctx)
    assert len(sends) == 2, [next_names(s) for s in sends]
    next_funcs = sends[0].next_functions
    assert len(next_funcs) == 2
    assert [fn.name() for fn, _ in next_funcs] == ["RecvRpcBackward"] * 2
    assert next_funcs[0][0] is next_funcs[1][0]
    next_funcs = sends[1].next_functions
    assert len(next_funcs) == 1
    assert next_funcs[0][0].name() == "RecvRpcBackward"


# --- running a function locally, by rpc_sync, rpc_async or remote --------------------------------
class ExecMode(Enum):
    LOCAL = 1
    RPC_SYNC = 2
    REMOTE = 3
    RPC_ASYNC = 4


def exec_func_with_dst(dst, mode, fn, *args):
    if mode == ExecMode.LOCAL:
        if len(args) == 1 and isinstance(args[0], list):
            return fn(*args[0])
        return fn(*args)
    if mode == ExecMode.RPC_SYNC:
        return rpc.rpc_sync(worker_name(dst), fn, args=args, timeout=WAIT)
    if mode == ExecMode.REMOTE:
        return rpc.remote(worker_name(dst), fn, args=args, timeout=WAIT).to_here(WAIT)
    if mode == ExecMode.RPC_ASYNC:
        return rpc.rpc_async(worker_name(dst), fn, args=args, timeout=WAIT).wait(WAIT)
    raise ValueError(f"unknown ExecMode {mode}")


def backward(context_id, roots, retain_graph=False, timeout=WAIT):
    """dist_autograd.backward, bounded: a pass that cannot finish fails instead of hanging."""
    dist_autograd.backward(context_id, roots, retain_graph=retain_graph, timeout=timeout)


def assert_close(got, want, where=""):
    got = got.array if isinstance(got, hg.Tensor) else np.asarray(got)
    want = want.array if isinstance(want, hg.Tensor) else np.asarray(want)
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    tol = 1e-5 if np.result_type(got.dtype, want.dtype) == np.float32 else 1e-10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=where)


def verify_backwards(mode, roots, context_id, local_grads, *args, timeout=WAIT):
    """LOCAL: run hpcgrad's backward and return each arg's .grad; otherwise run the distributed
    backward and check the context holds exactly those gradients (None: no entry)."""
    if mode == ExecMode.LOCAL:
        hg.autograd.backward(roots)
        return [arg.grad for arg in args]
    backward(context_id, roots, timeout=timeout)
    grads = dist_autograd.get_gradients(context_id)
    expected = 0
    for i, arg in enumerate(args):
        if local_grads[i] is not None:
            assert arg in grads, f"argument {i} has no gradient in the context"
            assert_close(grads[arg], local_grads[i], f"gradient of argument {i} ({mode.name})")
            expected += 1
        else:
            assert arg not in grads, f"argument {i} needs no gradient but got one"
    assert len(grads) == expected, f"{len(grads)} gradients, expected {expected}"
    return local_grads


def run_modes(modes, body, *args):
    """PyTorch's loop: ``body(mode, context_id, local_grads)`` per mode in a fresh context,
    LOCAL first; the grads LOCAL returns are what the distributed modes must match."""
    local_grads = None
    for mode in modes:
        with dist_autograd.context() as context_id:
            local_grads = body(mode, context_id, local_grads) or local_grads
    return local_grads


def wait_all(futures, timeout=WAIT):
    """torch.futures.wait_all: every value, or the first error once all are done."""
    values, error = [], None
    for future in futures:
        try:
            values.append(future.wait(timeout))
        except Exception as exc:  # noqa: BLE001  (the first is re-raised below)
            error = error or exc
    if error is not None:
        raise error
    return values


# --- builtin-like remote functions (torch ops hpcgrad spells differently or lacks) ---------------
class _Cos(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return hg.Tensor._make(np.cos(x.array), False, None, 0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * hg.tensor(-np.sin(x.array))


def cos(x):
    return _Cos.apply(x)


def narrow(t, dim, start, length):
    index = [slice(None)] * t.ndim
    index[dim] = slice(start, start + length)
    return t[tuple(index)]


def split(t, size):
    """torch.split(t, size) along dim 0."""
    return tuple(t[i:i + size] for i in range(0, t.shape[0], size))


def multi_dot(tensors):
    return functools.reduce(hg.matmul, tensors)


def ones(sizes, requires_grad=False):
    return hg.ones(*sizes, requires_grad=requires_grad)


# --- user functions of dist_autograd_test.py ------------------------------------------------------
def my_py_add(t1, t2):
    return hg.add(t1, t2)


def my_scalar_add(a, b):
    return a + b


def my_rref_add(rref_t1, t2):
    return hg.add(rref_t1.local_value(), t2)


def my_nested_rref_add(dst, rref_t1, t2):
    return rpc.rpc_sync(dst, my_rref_add, args=(rref_t1, t2), timeout=WAIT)


requires_grad_tensor = hg.ones(3, 3, requires_grad=True)


def ret_requires_grad():
    return requires_grad_tensor


def my_py_nested_call(t1, t2, dst, world_size, hops):
    next_dst = (dst + 1) % world_size
    if hops > 0:
        return rpc.rpc_sync(worker_name(next_dst), my_py_nested_call,
                            args=(t1, t2, next_dst, world_size, hops - 1), timeout=WAIT)
    return rpc.rpc_sync(worker_name(next_dst), my_py_add, args=(t1, t2), timeout=WAIT)


def compare_owner_value(context_id, rref, grad):
    """On the RRef's owner: the context's gradient of its value equals ``grad``."""
    grads = dist_autograd.get_gradients(context_id)
    got = grads[rref.local_value()]
    return got.array.shape == grad.shape and bool(np.allclose(got.array, grad, rtol=1e-5))


def create_tensor():
    return hg.ones(3, 3, requires_grad=True)


def run_trainer(rref_t1, t2, ps, rank_diff):
    """A trainer of the trainer/ps test: forward and backward, then hold the context until the
    parameter server has checked its gradients."""
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(ps, my_rref_add, args=(rref_t1, t2), timeout=WAIT)
        backward(context_id, [ret.sum()])
        rpc.rpc_sync(ps, set_rpc_done, args=(context_id, rank_diff), timeout=WAIT)
        rpc.rpc_sync(ps, check_rpc_done, args=(0,), timeout=WAIT)


class SimulateBackwardError(Function):
    simulate_error = True

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if SimulateBackwardError.simulate_error:
            raise Exception("Simulate error on backward pass")  # noqa: TRY002  (PyTorch's)
        return g


def set_simulate_error(value):
    SimulateBackwardError.simulate_error = value


def complex_python_udf(t1, t2):
    t3 = hg.nn.functional.linear(t1, t2)
    t4 = hg.nn.functional.linear(t2, t3)
    t5 = hg.nn.functional.linear(t3, t4)
    return multi_dot([t1, t2, t3, t4, t5])


def python_udf_with_backward_error(t1, t2):
    t3 = t1 + t2
    t4 = SimulateBackwardError.apply(t3)
    return multi_dot([t1, t2, t3, t4])


def nested_rpc_call_backward_error(t1, t2, dst):
    t1 = t1 * t2
    t2 = t1 + t2
    res = rpc.rpc_sync(worker_name(dst), python_udf_with_backward_error, args=(t1, t2),
                       timeout=WAIT)
    return multi_dot([t1, t2, res])


def nested_python_udf(t1, t2, dst):
    t3 = t1 * t2
    t4 = t1 + t2
    res = rpc.rpc_sync(worker_name(dst), my_py_add, args=(t3, t4), timeout=WAIT)
    return t1 * t2 * t3 * t4 * res


def nested_backward_accumulate_grads(t1, t2, dst_rank):
    return rpc.rpc_sync(worker_name(dst_rank), hg.add, args=(t1, t2), timeout=WAIT)


def mixed_requires_grad_operation(t1, t2):
    if t2.requires_grad:
        return t1 - t2
    return t1 * t2


class DebugInfoFunc(Function):
    """Checks, in the middle of a backward pass, that the pass is counted as running."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        passes = int(dist_autograd._get_debug_info()["num_current_backward_passes"])
        if not 1 <= passes <= 4:
            raise AssertionError(f"Expected 1 <= backward_passes <= 4, got {passes}")
        return g


def workload_thread():
    """test_async_dist_autograd: four RPCs to worker0 and a backward through them."""
    t1 = hg.rand(3, 3, requires_grad=True)
    t2 = hg.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        t3 = rpc.rpc_sync("worker0", hg.add, args=(t1, t2), timeout=WAIT)
        t4 = rpc.rpc_sync("worker0", hg.mul, args=(t2, t3), timeout=WAIT)
        t5 = rpc.rpc_sync("worker0", hg.matmul, args=(t3, t4), timeout=WAIT)
        t6 = rpc.rpc_sync("worker0", hg.add, args=(t4, t5), timeout=WAIT)
        backward(context_id, [t6.sum()])


def slow_add(t1, t2):
    time.sleep(1)
    t3 = t1 + t2
    t3.requires_grad = True
    return t3


# --- user functions and classes of rpc_test.py ----------------------------------------------------
value_future = concurrent.futures.Future()


def set_value(value):
    value_future.set_result(value)


def wait_for_value_future():
    return value_future.result(WAIT)


def my_function(a, b, c):
    return a + b + c


def my_tensor_function(a, b):
    return a + b


def my_sleep_func(seconds=1):
    time.sleep(seconds)
    return hg.mul(hg.tensor(1), hg.tensor(1))


def my_complex_tensor_function(list_input, tensor_class_input, dict_input):
    res = list_input[0]
    for t in list_input:
        res = res + t
    for v in dict_input.values():
        res = res + v
    complex_tensors = tensor_class_input.tensors
    return (res, complex_tensors[0], complex_tensors[1], complex_tensors[2])


def my_rref_function(rref_a, rref_b):
    return rref_a.to_here(WAIT) + rref_b.to_here(WAIT)


def add_rref_to_value(rref, value):
    return rref.to_here(WAIT) + value


def identity(a):
    return a


def no_result():
    print("do nothing")


def raise_or_inc(value):
    if value.numel() == 2:
        raise ValueError("Expected error")
    return value + 1


expected_err = "Expected error"
expected_err_escape = "\nFirst line of error \n next line of error \n last line of error"


def raise_func():
    raise ValueError(expected_err)


def raise_func_escape():
    raise ValueError(expected_err_escape)


def nested_rpc(dst):
    return rpc.rpc_sync(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)


def multi_layer_nested_async_rpc(dst, world_size, ttl):
    """Returns at once, leaving a chain of ``ttl`` asynchronous RPCs around the ring."""
    if ttl > 0:
        next_dst = (dst + 1) % world_size
        rpc.rpc_async(worker_name(dst), multi_layer_nested_async_rpc,
                      args=(next_dst, world_size, ttl - 1), timeout=WAIT)
        return 0


def nested_rref(dst):
    return (rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT),
            rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 2), timeout=WAIT))


def nested_remote(dst):
    rref = rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 3), timeout=WAIT)
    return rref.to_here(WAIT)


def rref_forward_chain(dst, world_size, rref, ttl):
    if ttl > 0:
        next_dst = (dst + 1) % world_size
        ret_rref = rpc.remote(worker_name(dst), rref_forward_chain,
                              args=(next_dst, world_size, rref, ttl - 1), timeout=WAIT)
        return [ret_rref]
    return rref.to_here(WAIT)


def rpc_return_rref(dst):
    return rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)


def light_rpc():
    return 0


def heavy_rpc(tensor):
    for i in range(1, 100):
        tensor = tensor * i
        tensor = tensor / (i + 1)
    return 0


def return_callee_id():
    return rpc.get_worker_info().id


def foo_add():
    return hg.add(hg.ones(1), hg.ones(1))


def non_cont_test(t_view, t_cont):
    if t_view.array.flags.c_contiguous:
        raise Exception("t_view is contiguous!")  # noqa: TRY002  (PyTorch's)
    if not t_cont.array.flags.c_contiguous:
        raise Exception("t_cont is not contiguous!")  # noqa: TRY002
    if not np.array_equal(t_view.data, t_cont.data):
        raise Exception("t_view is not equal to t_cont!")  # noqa: TRY002
    return t_view


class TensorClass:
    """PyTorch's namedtuple TensorClass(tensors), as a class (a namedtuple's fields are not
    searched for tensors either)."""

    def __init__(self, tensors):
        self.tensors = tensors


def build_complex_tensors():
    a = hg.ones(3, 3)
    b = [a, a]
    c = [b, b]
    d = [a, b]
    e = {"a": d}  # PyTorch keys this dict by the tensor a itself
    return [a, b, c, d, e]


class MyClass:
    def __init__(self, a, delay=False):
        self.a = a
        if delay:
            time.sleep(2)

    def my_instance_method(self, b):
        return self.a + b

    @classmethod
    def my_class_method(cls, d, e):
        return d + e

    @staticmethod
    def my_static_method(f):
        return f > 10

    def increment_value(self, increment):
        self.a += increment

    def get_value(self):
        return self.a


def get_rref_list(values):
    return [rpc.RRef(MyClass(a)) for a in values]


def add_use_future_cb(to, x, y, z):
    out = concurrent.futures.Future()

    def callback(fut):
        out.set_result(fut.wait() + z)

    fut = rpc.rpc_async(to, hg.add, args=(x, y), timeout=WAIT)
    fut.then(callback)
    return out.result(WAIT)


# --- DistributedOptimizer (dist_optimizer_test.py) ------------------------------------------------
class MyModule:
    def __init__(self, requires_grad=True):
        rng = np.random.default_rng(0)  # each module draws the same weight
        self.w = hg.tensor(rng.random((3, 3)).astype(np.float32), requires_grad=requires_grad)

    def forward(self, t1):
        return hg.matmul(self.w, t1)

    def get_w(self):
        return self.w


def call_method(method, obj_rref, *args, **kwargs):
    return method(obj_rref.local_value(), *args, **kwargs)


def remote_method(method, obj_rref, *args, **kwargs):
    return rpc.remote(obj_rref.owner(), call_method, args=[method, obj_rref] + list(args),
                      kwargs=kwargs, timeout=WAIT)


def rpc_async_method(method, obj_rref, *args, **kwargs):
    return rpc.rpc_async(obj_rref.owner(), call_method, args=[method, obj_rref] + list(args),
                         kwargs=kwargs, timeout=WAIT)


class FailingOptimizer(hg.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise ValueError("Error running optimizer.")


class OptimizerFailingOnConstructor(hg.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")

    def step(self, closure=None):
        raise NotImplementedError


def owned_rref_count():
    """How many RRef values this rank owns and keeps for others (PyTorch's num_owner_rrefs)."""
    with rpc._rref_lock:
        return len(rpc._rrefs)


def set_global_rref(rref):
    global global_rref
    global_rref = rref


def clear_global_rref():
    global global_rref
    global_rref = None


global_rref = None


def first_of_two(t1, t2):
    """Ignores its second argument (which may require grad)."""
    return t1 * 2.0
