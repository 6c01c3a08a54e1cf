"""Logic shared by the RPC and distributed-autograd tests: the RPC fixtures, the functions that
run remotely, seeded weights, and models run across ranks and, as the reference, in one process.

Functions called through RPC live here, at module level: every rank imports this module under
the same name (tests/ is on sys.path), so the callee unpickles them by reference.
A weight is named after the rank that owns it and drawn from a seed derived from its name, so
the caller can rebuild every rank's weights and compute the reference gradients locally.
"""

import logging
import threading
import time
import zlib

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad.autograd import Function
from hpcgrad.comm.mpi import comm_world

WAIT_LIMIT = 20    # seconds any wait in these tests may last before it fails
FEATURES = 5       # width of every activation and weight


# --- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rpc_worker():
    """RPC on this rank for the whole module (init_rpc and shutdown are collective)."""
    rank = comm_world().Get_rank()
    rpc.init_rpc(f"worker{rank}")
    yield rank
    rpc.shutdown(timeout=WAIT_LIMIT)


@pytest.fixture(autouse=True)
def rpc_step(rpc_worker):
    """Every rank leaves a test together, so no test sees another's contexts or requests."""
    yield
    barrier()


def barrier():
    """Every rank gets here (requests keep being served meanwhile), within WAIT_LIMIT."""
    rpc._require_agent().join(WAIT_LIMIT)


def rank_and_size():
    info = rpc.get_worker_info()
    return info.id, comm_world().Get_size()


# --- plain remote functions -----------------------------------------------------------------------
def add(a, b):
    return a + b


def echo(obj):
    return obj


def whoami():
    return rpc.get_worker_info()


def raise_value_error(text):
    raise ValueError(text)


_wake = threading.Event()
_sleeper = []  # the name of the thread blocked in sleep_until_woken, once it is there


def sleep_until_woken(seconds):
    """Blocks the thread serving it up to ``seconds`` (``wake`` ends it early)."""
    _sleeper.append(threading.current_thread().name)
    _wake.wait(seconds)
    return "woke"


def sleeper():
    """The thread blocked in sleep_until_woken, or None before it has arrived."""
    return _sleeper[-1] if _sleeper else None


def wake():
    _wake.set()


def reset_wake():
    _wake.clear()
    _sleeper.clear()


def agent_state():
    """What this rank still holds: requests awaiting replies and distributed-autograd state."""
    return dict(pending=rpc._require_agent().pending_count(), **dist_autograd._get_debug_info())


def wait_until_idle(ranks, limit=WAIT_LIMIT):
    """Poll ``agent_state`` on ``ranks`` until nothing is held (releases travel asynchronously)."""
    me = rpc.get_worker_info().id
    deadline = time.monotonic() + limit
    while True:
        states = {r: (agent_state() if r == me else rpc.rpc_sync(r, agent_state)) for r in ranks}
        if all(v == 0 for s in states.values() for v in s.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"state left behind after {limit} s: {states}")
        time.sleep(0.01)


# --- seeded weights -------------------------------------------------------------------------------
_weights = {}
_weights_lock = threading.Lock()


def seeded(name, shape=(FEATURES, FEATURES)):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.standard_normal(shape) * 0.5


def weight(name, registry):
    """The weight ``name`` of ``registry`` (a dict), created from its seed on first use."""
    with _weights_lock:
        w = registry.get(name)
        if w is None:
            w = registry[name] = hg.tensor(seeded(name), requires_grad=True)
        return w


def owned_weight(name):
    """This rank's weight ``name`` (the one distributed runs use and update)."""
    return weight(name, _weights)


def context_grads(context_id):
    """{weight name: (gradient array in the context, .grad is None)} for this rank's weights."""
    grads = dist_autograd.get_gradients(context_id)
    with _weights_lock:
        owned = dict(_weights)
    return {name: (grads[w].array, w.grad is None) for name, w in owned.items() if w in grads}


def weight_value(name):
    return owned_weight(name).array.copy()


# --- models: the same code runs across ranks (mode "rpc") and in one process (a dict of weights) --
def call(rank, fn, *args):
    """Run ``fn(*args)`` on ``rank`` by RPC, or here when the last argument is a local registry."""
    registry = args[-1]
    if registry == "rpc":
        return rpc.rpc_sync(rank, fn, args=args, timeout=WAIT_LIMIT)
    return fn(*args)


def _weights_of(registry):
    return _weights if registry == "rpc" else registry


def stage(h, name, registry):
    """tanh(h @ W[name])."""
    return (h @ weight(name, _weights_of(registry))).tanh()


def two_stages(a, b, name, registry):
    """A stage that takes two tensors (a tensor sent twice in one call when a is b)."""
    w = weight(name, _weights_of(registry))
    return ((a @ w) * b).tanh() + a


def relay(h, rank, size, registry):
    """On ``rank``: its stage, then on to the next rank (an RPC while serving one), if any."""
    h = stage(h, f"c{rank}", registry)
    if rank + 1 < size:
        h = call(rank + 1, relay, h, rank + 1, size, registry)
    return h


def chain(x, size, registry):
    """0 -> 1 -> 2 ... -> last and back: each rank calls the next while serving the previous."""
    y = call(1, relay, x, 1, size, registry)
    return (y * y).sum()


def around(h, me, peer, registry):
    """On ``me``: its stage, then ``peer``'s (nested RPC), then its own again."""
    h = stage(h, f"n{me}a", registry)
    h = call(peer, stage, h, f"n{peer}b", registry)
    return stage(h, f"n{me}c", registry)


def nested(x, size, registry):
    """Rank 1 calls rank 2 while serving rank 0, and rank 0 calls rank 2 directly as well."""
    y = call(1, around, x, 1, 2, registry)
    z = call(2, stage, x, "d2", registry)
    return (y * z).sum() + (y * y).sum()


def fan_out_in(x, size, registry):
    """x goes to every other rank at once (rpc_async); the results meet again on rank 0."""
    local_w = weight("f0", _weights_of(registry))
    if registry == "rpc":
        futures = [rpc.rpc_async(r, stage, args=(x, f"f{r}", registry), timeout=WAIT_LIMIT)
                   for r in range(1, size)]
        parts = [f.wait() for f in futures]
    else:
        parts = [stage(x, f"f{r}", registry) for r in range(1, size)]
    total = x @ local_w
    for p in parts:
        total = total + p * p
    return total.sum()


def sent_twice(x, size, registry):
    """x reaches rank 1 in two calls and twice within one call."""
    y1 = call(1, stage, x, "t1a", registry)
    y2 = call(1, stage, x, "t1b", registry)
    y3 = call(1, two_stages, x, x, "t1c", registry)
    return (y1 * y2 + y3).sum()


MODELS = {"chain": chain, "nested": nested, "fan": fan_out_in, "twice": sent_twice}


def check_model(model, seed=0, expect_idle=True):
    """Run ``model`` from rank 0 in a context; compare every rank's gradients with one process.
    ``expect_idle``: afterwards no rank holds a context, a backward pass or a request."""
    _, size = rank_and_size()
    x_data = np.random.default_rng(seed).standard_normal((3, FEATURES))
    x = hg.tensor(x_data, requires_grad=True)
    with dist_autograd.context() as ctx:
        loss = model(x, size, "rpc")
        dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
        got = dist_autograd.get_gradients(ctx)
        remote = {}
        for r in range(size):
            remote.update(context_grads(ctx) if r == 0 else rpc.rpc_sync(r, context_grads,
                                                                            args=(ctx,)))
    reference = {}
    x_ref = hg.tensor(x_data, requires_grad=True)
    ref_loss = model(x_ref, size, reference)
    ref_loss.backward()
    np.testing.assert_allclose(loss.array, ref_loss.array, rtol=1e-12)
    assert x.grad is None, "distributed backward must leave .grad alone"
    np.testing.assert_allclose(got[x].array, x_ref.grad.array, rtol=1e-10, atol=1e-12)
    assert sorted(remote) == sorted(reference), (sorted(remote), sorted(reference))
    for name, (grad, untouched) in remote.items():
        assert untouched, f"{name}.grad was set by a distributed backward"
        np.testing.assert_allclose(grad, reference[name].grad.array, rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    if expect_idle:
        wait_until_idle(range(size))
    return got[x].array


# --- backward nodes that fail or stall ---------------------------------------------------------------
class _FailInBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise ValueError("deliberate failure in a backward node")


class _StallInBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        _wake.wait(5)
        return g


def fail_in_backward(x):
    return _FailInBackward.apply(x * 2.0)


def stall_in_backward(x):
    return _StallInBackward.apply(x * 2.0)


def fail_via(x, rank):
    """Forward to ``rank``'s failing node through this rank (nested)."""
    return rpc.rpc_sync(rank, fail_in_backward, args=(x * 3.0,), timeout=WAIT_LIMIT) * 1.0


def check_pipeline(seed=0):
    """SPMD send/recv: rank r receives from r - 1, applies its stage and sends on; the last rank
    computes the loss and runs backward, the others wait_for_backward. Each rank checks its own
    gradients against the whole model run in one process."""
    rank, size = rank_and_size()
    x_data = np.random.default_rng(seed).standard_normal((4, FEATURES))
    reference, x_ref = {}, hg.tensor(x_data, requires_grad=True)
    h = x_ref
    for r in range(size):
        h = stage(h, f"p{r}", reference)
    (h * h).sum().backward()

    x = hg.tensor(x_data, requires_grad=True)
    with dist_autograd.context() as ctx:
        h = x if rank == 0 else dist_autograd.recv(rank - 1, timeout=WAIT_LIMIT)
        h = stage(h, f"p{rank}", "rpc")
        if rank + 1 < size:
            dist_autograd.send(h, rank + 1)
            dist_autograd.wait_for_backward(ctx, timeout=WAIT_LIMIT)
        else:
            dist_autograd.backward(ctx, [(h * h).sum()], timeout=WAIT_LIMIT)
        grads = dist_autograd.get_gradients(ctx)
    w = owned_weight(f"p{rank}")
    assert w.grad is None and x.grad is None
    np.testing.assert_allclose(grads[w].array, reference[f"p{rank}"].grad.array, rtol=1e-10)
    if rank == 0:
        np.testing.assert_allclose(grads[x].array, x_ref.grad.array, rtol=1e-10)
    else:
        assert len(grads) == 1, "only the rank's own weight gets a gradient here"


def check_optimizer(steps=2, lr=0.1, momentum=0.9):
    """DistributedOptimizer over weights on every other rank equals a local SGD on copies."""
    from hpcgrad import optim
    from hpcgrad.distributed.optim import DistributedOptimizer
    _, size = rank_and_size()
    names = [f"o{r}" for r in range(1, size)]
    rrefs = [rpc.remote(r, owned_weight, args=(n,)) for r, n in zip(range(1, size), names)]
    opt = DistributedOptimizer(optim.SGD, rrefs, lr=lr, momentum=momentum)
    reference = {n: hg.tensor(seeded(n), requires_grad=True) for n in names}
    ref_opt = optim.SGD(list(reference.values()), lr=lr, momentum=momentum)
    for step in range(steps):
        x = hg.tensor(np.random.default_rng(step).standard_normal((3, FEATURES)))
        with dist_autograd.context() as ctx:
            loss = sum(((y := call(r, stage, x, n, "rpc")) * y).sum()
                       for r, n in zip(range(1, size), names))
            dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
            opt.step(ctx)
        ref_opt.zero_grad()
        sum(((y := stage(x, n, reference)) * y).sum() for n in names).backward()
        ref_opt.step()
        for r, n in zip(range(1, size), names):
            np.testing.assert_allclose(rpc.rpc_sync(r, weight_value, args=(n,)),
                                       reference[n].array, rtol=1e-12, err_msg=f"{n}, step {step}")


def run_in_threads(threads, per_thread, fn):
    """``fn(index)`` for ``threads * per_thread`` indices, ``per_thread`` in a row on each thread;
    returns {index: result} and re-raises the first failure."""
    results, errors = {}, []

    def work(t):
        try:
            for i in range(t * per_thread, (t + 1) * per_thread):
                results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(WAIT_LIMIT * 3)
    assert not any(t.is_alive() for t in pool), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


# --- issue 11: graph shape, hooks, passes, concurrency ----------------------------------------------
def three_parts(x):
    """Several tensors in one result: x*1, x*2, x*3."""
    return x * 1.0, x * 2.0, x * 3.0


def first_of_two(a, b):
    """Ignores its second grad-requiring argument (it came in the same message as the first)."""
    return a * 2.0


def message_graph(context_id):
    """[(number of next edges, number of inputs)] of the context's send and recv functions."""
    ctx = dist_autograd.container.retrieve(context_id)
    return ([len(fn.next_edges) for fn in ctx.send_functions.values()],
            [len(fn.input_metadata) for fn in ctx.recv_functions.values()])


_fail_switch = threading.Event()


def set_failing(on):
    """Switch ``fail_while_set``'s backward failure on or off on this rank."""
    (_fail_switch.set if on else _fail_switch.clear)()


class _FailWhileSet(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if _fail_switch.is_set():
            raise ValueError("deliberate failure while switched on")
        return g


def fail_while_set(x):
    return _FailWhileSet.apply(x * 2.0)


_stalled = threading.Semaphore(0)


class _StallUntilWoken(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        _stalled.release()
        _wake.wait(WAIT_LIMIT)
        return g


def stall_until_woken(x):
    return _StallUntilWoken.apply(x * 2.0)


def stalled_count():
    """How many backward Nodes have stalled in stall_until_woken so far (and forget them)."""
    n = 0
    while _stalled.acquire(blocking=False):
        n += 1
    return n


_log_records = []


class _ListHandler(logging.Handler):
    def emit(self, record):
        _log_records.append(record.getMessage())


def capture_rpc_log():
    """Keep this rank's RPC error log in a list (``rpc_log``) from now on."""
    logger = logging.getLogger("hpcgrad.rpc")
    if not any(isinstance(h, _ListHandler) for h in logger.handlers):
        logger.addHandler(_ListHandler())
    _log_records.clear()


def rpc_log():
    return list(_log_records)


class Cast(Function):
    """``x`` in ``dtype``; its gradient comes back in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return hg.tensor(x.array.astype(dtype))

    @staticmethod
    def backward(ctx, g):
        return hg.tensor(g.array.astype(ctx.dtype)), None


def times_three(x):
    return x * 3.0


class FailingOptimizerOnConstructor:
    """An optimizer class whose constructor raises (on the parameters' owner)."""

    def __init__(self, params, **kwargs):
        raise ValueError("Error creating optimizer.")


_kept = {}


def keep(name, value):
    """Hold ``value`` (an RRef, say) on this rank under ``name``."""
    _kept[name] = value


def kept(name):
    return _kept[name]


def drop(name):
    _kept.pop(name, None)
