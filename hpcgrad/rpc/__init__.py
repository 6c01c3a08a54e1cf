"""torch.distributed.rpc on MPI: init_rpc, rpc_sync, rpc_async, remote/RRef (and its proxies), shutdown.

Functions run on the callee's pool threads, or on its thread parked in ``shutdown()`` (Note
[Serving threads] in agent.py); a remote exception is raised in the caller with the remote rank
and traceback, and logged on the rank where it happened. A function decorated with
``rpc.functions.async_execution`` returns a Future, and its reply goes when that completes
(Note [Async execution] in functions.py).

Note [RPC codec]
    RPC knows nothing of autograd. One codec rides along with every message: ``on_send`` gets
    the tensors of a message that require grad and returns metadata for the header (or None);
    the receiver's ``on_receive`` gets them back with that metadata; ``request_fields`` adds
    fields to a request's envelope (the caller's state) and ``serving(envelope)`` is the scope
    a request is served and its result encoded in. hpcgrad.distributed.autograd registers its
    codec when it is imported (``register_codec``) and installs its message handlers through
    ``install(agent)`` at init_rpc, before the agent serves.
"""

import collections
import contextlib
import itertools
import logging
import math
import enum
import functools
import numbers
import threading
import traceback

from hpcgrad.comm.flight_recorder import agree_job_id, install_signal_handler
from hpcgrad.comm.mpi import comm_world
from hpcgrad.comm.ulfm import ProcessFailure  # noqa: F401  (an RPC to a worker that died)
from hpcgrad.comm.work import default_timeout
from hpcgrad.rpc import functions, message
from hpcgrad.rpc.agent import (AgentShutDown, MPIRpcAgent, RpcError, RpcFuture,  # noqa: F401
                               RpcTimeoutError)

DEFAULT_RPC_TIMEOUT = 60.0
UNSET_RPC_TIMEOUT = -1.0   # as PyTorch: a timeout argument left out means the default
DEFAULT_SHUTDOWN_TIMEOUT = 0  # as PyTorch: shutdown() waits without a limit
_default_timeout = DEFAULT_RPC_TIMEOUT
_log = logging.getLogger(__name__)

WorkerInfo = collections.namedtuple("WorkerInfo", ["name", "id"])
_agent = None
_rrefs = {}            # rref id -> value, on the owner, while some RRef handle refers to it
_rref_users = {}       # rref id -> handles alive (Note [RRef reference counting])
_rref_lock = threading.Lock()
_rref_created = threading.Condition(_rref_lock)  # a fetch may arrive before its remote() ran
_rref_ids = itertools.count(1)


class Codec:
    """What travels with every message besides its values: Note [RPC codec]. This one adds
    nothing; hpcgrad.distributed.autograd registers its own."""

    def install(self, agent):
        """init_rpc: register message handlers on ``agent`` (before it serves)."""

    def uninstall(self):
        """shutdown: the agent is gone."""

    def request_fields(self, dst):
        """Extra envelope fields of a request to ``dst`` (picklable values)."""
        return {}

    def on_send(self, dst, tensors):
        """Metadata for the header of a message to ``dst`` carrying ``tensors`` (requires_grad)."""
        return None

    def on_receive(self, src, tensors, metadata):
        """The tensors of a message from ``src`` whose sender's ``on_send`` gave ``metadata``."""

    def serving(self, envelope):
        """The scope a request (its envelope) is served and its result encoded in."""
        return contextlib.nullcontext()


_codec = Codec()


def register_codec(codec):
    """Use ``codec`` for every message from now on (installed at once if RPC is running)."""
    global _codec
    _codec = codec
    if _agent is not None:
        codec.install(_agent)


def _require_agent():
    if _agent is None:
        raise RuntimeError("RPC has not been initialized. Call "
                           "hpcgrad.distributed.rpc.init_rpc(name) on every rank first.")
    return _agent


class BackendType(enum.Enum):
    """PyTorch's ``rpc.BackendType``: TENSORPIPE names the one backend here (MPI)."""

    TENSORPIPE = "TENSORPIPE"


class RpcBackendOptions:
    """init_rpc's options, with the names of PyTorch's ``TensorPipeRpcBackendOptions``.

    ``rpc_timeout`` (s; 0: none) becomes the default timeout of RPCs (``get_rpc_timeout``) and,
    as in PyTorch, bounds init_rpc itself. ``num_worker_threads`` serve requests on each rank.
    ``init_method`` is accepted and ignored: mpiexec/srun already placed the ranks.
    """

    def __init__(self, *, num_worker_threads=8, rpc_timeout=DEFAULT_RPC_TIMEOUT,
                 init_method=None):
        if (not isinstance(num_worker_threads, numbers.Integral)
                or isinstance(num_worker_threads, bool) or num_worker_threads < 1):
            raise ValueError(f"num_worker_threads must be an int >= 1, got {num_worker_threads!r}")
        self.num_worker_threads = int(num_worker_threads)
        self.rpc_timeout = _checked_timeout(rpc_timeout, "rpc_timeout", unset_allowed=False)
        self.init_method = init_method

    def __repr__(self):
        return (f"RpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
                f"rpc_timeout={self.rpc_timeout:g})")


TensorPipeRpcBackendOptions = RpcBackendOptions  # PyTorch's name; there is one backend here


def init_rpc(name, backend=None, rank=None, world_size=None, rpc_backend_options=None,
             allowed=None):
    """Start this rank's agent. Every rank calls it (collective); names must be unique.

    PyTorch's arguments: ``backend`` may only be left out (one backend); ``rank`` and
    ``world_size``, if given, must be MPI's. With ``rpc_backend_options`` (an
    RpcBackendOptions), its ``rpc_timeout`` becomes the default RPC timeout and bounds this
    call; without, the bound is HPCGRAD_COMM_TIMEOUT (30 min; PyTorch's rendezvous waits as
    long for every worker). A rank missing past the bound ends the job, rank 0 naming the
    missing ranks (Note [Bounded start-up] in comm/rendezvous.py).

    ``allowed`` (hpcgrad's; None: every rank is trusted, as in PyTorch) restricts what this
    rank runs for others: an iterable of callables and classes (allowed exactly, e.g.
    ``[mymodule.train_step, numpy.add]``) and strings (module-name prefixes, e.g.
    ``"mypkg.models"`` or ``"numpy"``). Every message this rank receives (requests, replies)
    is unpickled refusing any global outside that set, the built-in ones RPC itself needs
    (tensor and array placeholders, RRefs, WorkerInfo, numpy scalars and dtypes) and a few
    data-only constructors: a refused call never runs, a refused argument's ``__reduce__``
    never runs, and the caller gets an error naming the refused global (Note [What a worker
    unpickles] in message.py). Results coming back must pass the same check, so allow the
    classes your callees return.
    """
    global _agent, _default_timeout
    if _agent is not None:
        raise RuntimeError(f"RPC is already initialized: init_rpc was already called on this "
                           f"rank (as {_agent.name!r}); call shutdown() first")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType (hpcgrad has one: "
                        f"rpc.BackendType.TENSORPIPE, or leave it out), got {backend!r}")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError(f"Argument rpc_backend_options must be an instance of RpcBackendOptions "
                        f"(rpc.TensorPipeRpcBackendOptions(rpc_timeout=...)), got "
                        f"{type(rpc_backend_options).__name__}")
    options = rpc_backend_options or RpcBackendOptions()
    comm = comm_world()
    policy = None if allowed is None else message.Allowed(
        allowed, f"init_rpc(allowed=...) on {name!r} (rank {comm.Get_rank()})")
    if rank == -1:  # PyTorch's default: not given
        rank = None
    if rank is not None and rank != comm.Get_rank():
        raise ValueError(f"rank={rank} but this process is MPI rank {comm.Get_rank()}: under "
                         "mpiexec the MPI rank is the RPC rank (leave rank out)")
    if world_size is not None and world_size != comm.Get_size():
        raise ValueError(f"world_size={world_size} but the MPI job has {comm.Get_size()} ranks")
    init_timeout = options.rpc_timeout if rpc_backend_options is not None else default_timeout()
    agent = MPIRpcAgent(name, comm, options.num_worker_threads, init_timeout=init_timeout,
                        allowed=policy)
    agree_job_id(comm)  # after the agent's bounded start-up: every rank is here (Note [Job ids])
    if rpc_backend_options is not None:
        _default_timeout = options.rpc_timeout
    for kind, handler in (("call", _serve_call), ("remote", _serve_remote),
                          ("fetch", _serve_fetch)):
        agent.register_handler(kind, handler)
    agent.register_handler("fork", _serve_fork, inline=True)
    agent.register_handler("forget", _serve_forget, inline=True)
    _codec.install(agent)
    _agent = agent
    # As init_process_group: SIGUSR2 dumps this rank's flight record (Note [Flight recorder])
    # instead of killing an RPC-only rank with the signal's default action. Before start():
    # a peer's request served the moment the agent starts may raise the signal (CI saw a rank
    # killed when the handler came after).
    install_signal_handler()
    agent.start()  # only now: a request arriving earlier would find no handler
    return agent


def shutdown(graceful=True, timeout=DEFAULT_SHUTDOWN_TIMEOUT):
    """Stop the agent, as PyTorch's ``rpc.shutdown``.

    ``graceful``: first wait until every rank has called shutdown and all outstanding work
    (requests in flight or being served, replies not yet received) is done everywhere, serving
    this rank's requests meanwhile (Note [Quiet shutdown] in agent.py): a worker parked here
    serves while the master trains, however long. ``timeout`` (s) bounds that wait: 0 (the
    default, PyTorch's) none, UNSET_RPC_TIMEOUT the default RPC timeout; past it this rank
    still shuts down, then raises RpcTimeoutError. ``graceful=False``: stop at once, locally.
    """
    global _agent
    timeout = _timeout_of(timeout, "shutdown")
    agent = _require_agent()
    try:
        if graceful:
            agent.quiesce(timeout, close=True)
    finally:  # as PyTorch, a failed wait still ends this rank's agent
        agent.fail_pending(RpcError("RPC agent shut down before the reply arrived"))
        agent.stop()
        _agent = None
        _codec.uninstall()
        with _rref_lock:
            _rrefs.clear()
            _rref_users.clear()


def get_rpc_timeout():
    """The default timeout of RPCs, in seconds (0: none), as PyTorch's ``rpc.get_rpc_timeout``."""
    return _default_timeout


def _set_rpc_timeout(timeout):
    """Set the default timeout (seconds; 0: none) of RPCs that give none themselves."""
    global _default_timeout
    _default_timeout = _checked_timeout(timeout, "_set_rpc_timeout", unset_allowed=False)


def _checked_timeout(timeout, what, unset_allowed=True):
    """``timeout`` as float seconds >= 0 (0: none), or None for "the default" (None or
    UNSET_RPC_TIMEOUT, where ``unset_allowed``); anything else is a clear error, as in PyTorch
    only -1 is special among negative values."""
    if unset_allowed and (timeout is None or timeout == UNSET_RPC_TIMEOUT):
        return None
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(f"{what}: timeout must be a number of seconds, got "
                        f"{type(timeout).__name__} {timeout!r}")
    if not math.isfinite(timeout) or timeout < 0:
        unset = (f", or {UNSET_RPC_TIMEOUT:g} (UNSET_RPC_TIMEOUT) for the default"
                 if unset_allowed else "")
        raise ValueError(f"{what}: timeout must be a finite number of seconds >= 0 (0: no "
                         f"timeout{unset}), got {timeout!r}")
    return float(timeout)


def _timeout_of(timeout, what="RPC"):
    """A checked timeout; the default (``get_rpc_timeout``) when left out."""
    checked = _checked_timeout(timeout, what)
    return _default_timeout if checked is None else checked


def get_worker_info(worker_name=None):
    """WorkerInfo(name, id) of this rank, or of the worker with that name (or rank)."""
    agent = _require_agent()
    if worker_name is None:
        return WorkerInfo(agent.name, agent.rank)
    rank = _rank_of(worker_name)
    return WorkerInfo(agent.names[rank], rank)


def _rank_of(to):
    agent = _require_agent()
    if isinstance(to, WorkerInfo):
        return to.id
    if isinstance(to, numbers.Integral) and not isinstance(to, bool):
        if not 0 <= to < agent.size:
            raise RuntimeError(f"Unknown destination worker {to}: could not find destination: "
                               f"no worker with rank {to} (world size {agent.size}; ranks are "
                               f"0 to {agent.size - 1})")
        return int(to)
    if not isinstance(to, str):
        raise ValueError(f"a destination is a worker name, a rank (int) or a WorkerInfo; got "
                         f"{type(to).__name__} {to!r}")
    if to not in agent.names:
        raise RuntimeError(f"Unknown destination worker {to}: could not find destination: "
                           f"unknown worker {to!r}; workers are {agent.names}")
    return agent.names.index(to)


# --- calls ------------------------------------------------------------------------------------
def _encode(obj, dst):
    return message.encode(obj, lambda tensors: _codec.on_send(dst, tensors))


def _decode(body, payloads, src):
    agent = _agent
    return message.decode(body, payloads,
                          lambda tensors, metadata: _codec.on_receive(src, tensors, metadata),
                          loads=agent.loads if agent is not None else _strict_loads)


def _strict_loads(data):
    """A message decoded after shutdown: the built-in globals only."""
    return message.Allowed(()).loads(data)


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Run ``func(*args, **kwargs)`` on worker ``to``; returns a future of its result.
    ``timeout`` in seconds: left out, the default (``get_rpc_timeout``); 0, none."""
    return _call(to, "call", (func, tuple(args or ()), dict(kwargs or {})),
                 _timeout_of(timeout, "rpc_async"))


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """``rpc_async(...).wait()``: blocks until the result arrives, or raises past ``timeout``."""
    return rpc_async(to, func, args, kwargs, _timeout_of(timeout, "rpc_sync")).wait()


def _call(to, kind, obj, timeout, keep=(), name=None):
    """Send a request of ``kind`` to ``to``; ``timeout``: checked seconds (0: none). ``keep``:
    objects held until the reply has arrived (an RRef a proxy call names by id: Note [RRef
    proxies]); ``name``: what the call is called in messages (default: the function's name)."""
    agent = _require_agent()
    dst = _rank_of(to)
    body, payloads = _encode(obj, dst)
    if name is None:
        name = getattr(obj[0], "__qualname__", kind) if kind in ("call", "remote") else kind
    result = RpcFuture(f"RPC {name} to {agent.names[dst]} (rank {dst})", timeout, agent=agent)
    # With no callback chained to ``result`` (rpc_sync, a plain wait) the reply is decoded and
    # its waiter woken on the progress thread: Note [Replies on the callback pool].
    reply = agent.request(dst, kind, body, payloads, describe=result.describe, timeout=timeout,
                          inline_reply=lambda: not result.has_callbacks(),
                          **_codec.request_fields(dst))

    def unpack(fut, _keep=keep):  # on the callback pool or the progress thread (see above)
        try:
            envelope, payloads = fut.value()
            if envelope["kind"] == "error":
                result.set_exception(_remote_error(envelope))
            else:
                result.set_result(_decode(envelope["body"], payloads, dst))
        except BaseException as exc:
            result.set_exception(exc)

    reply.add_done_callback(unpack)
    return result


def _remote_error(envelope):
    """The remote exception, re-created in the caller when its type allows, with the remote trace."""
    text = (f"{envelope['error_type']} on {envelope['worker']} (rank {envelope['rank']}): "
            f"{envelope['error']}\nRemote traceback:\n{envelope['traceback']}")
    error_class = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
                   "IndexError": IndexError, "ZeroDivisionError": ZeroDivisionError,
                   "AttributeError": AttributeError, "NotImplementedError": NotImplementedError,
                   "ArithmeticError": ArithmeticError}.get(envelope["error_type"], RpcError)
    return error_class(text)


def error_fields(exc, what="a request"):
    """The envelope fields of an error reply; the error is logged here, where it happened."""
    agent = _require_agent()
    trace = "".join(traceback.format_exception(exc))
    _log.error("%s (rank %d) failed serving %s: %s", agent.name, agent.rank, what, trace)
    return dict(error=str(exc), error_type=type(exc).__name__, traceback=trace,
                worker=agent.name, rank=agent.rank)


def _serve_call(src, envelope, payloads):
    agent = _require_agent()
    what = f"an RPC from rank {src}"
    try:
        with _codec.serving(envelope):
            func, args, kwargs = _decode(envelope["body"], payloads, src)
            result = func(*args, **kwargs)
            future = functions.future_of(func, result)
            if future is not None:  # Note [Async execution]: reply when it completes
                _reply_when_done(agent, src, envelope, future, what)
                return
            body, out = _encode(result, src)
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error", **error_fields(exc, what))
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C on a serving main thread: the caller
            raise                               # has its answer; this rank stops serving


def _reply_when_done(agent, src, envelope, future, what, rref_id=None):
    """Reply to ``envelope`` once ``future`` (an async function's) completes, on the thread that
    completes it: its value encoded as a normal reply, in the request's codec scope, or its
    error. ``rref_id``: a remote() call's, whose value (or error) the owner keeps. Counted as
    this rank's outstanding work until sent (Note [Async execution] in functions.py)."""
    agent.work_started()

    def reply(fut):
        try:
            if not agent.running:  # stopped without waiting for it (graceful=False)
                return
            try:
                value = fut.value()
            except BaseException as exc:  # noqa: BLE001  (the caller's error)
                if rref_id is not None:
                    _add_users(rref_id, 1, _Failed(exc))  # to_here() raises it too
                agent.reply(src, envelope["id"], "error", **error_fields(exc, what))
                return
            try:
                with _codec.serving(envelope):
                    if rref_id is not None:
                        _add_users(rref_id, 1, value)  # its creator's handle
                        value = None
                    body, out = _encode(value, src)
            except BaseException as exc:  # noqa: BLE001  (a value that cannot be sent)
                agent.reply(src, envelope["id"], "error", **error_fields(exc, what))
                return
            agent.reply(src, envelope["id"], "result", body, out)
        finally:
            agent.work_done()

    future.add_done_callback(reply)


# --- remote references --------------------------------------------------------------------------
# Note [RRef reference counting]
#     An owner keeps a value in ``_rrefs`` while RRef handles to it exist anywhere; a handle is
#     an RRef made by remote() or by unpickling (an owner's own ``RRef(value)`` holds its value
#     itself and is not counted). Every pickled RRef becomes one handle where it is unpickled, so
#     pickling adds one user at the owner *before* the message leaves (on the owner itself at
#     once; elsewhere by a "fork" round trip to the owner), and a handle's deletion removes one
#     (a "forget" message; sent from the progress thread, as __del__ may run anywhere). Adding
#     always happens before the matching removal, so the count reaches 0 only when no handle is
#     left: then the owner drops the value. remote() counts its creator's handle when the owner
#     runs it; a "forget" overtaking it takes the count to -1 and the value is never stored.
_NO_VALUE = object()


class RRef:
    """A reference to a value that lives on its owner.

    ``RRef(value)`` makes one owned by this rank; ``remote(...)`` returns one owned by the
    callee. Passed to another rank in an RPC, it refers to the same value, which its owner
    keeps while any rank holds such a reference (Note [RRef reference counting]).
    """

    def __init__(self, value):
        agent = _require_agent()
        self._owner, self._id = agent.rank, (agent.rank << 40) | next(_rref_ids)
        self._value = value       # an owner's own RRef holds its value itself
        self._created = None

    @classmethod
    def _handle(cls, owner, rref_id, created=None):
        """A counted RRef to the value ``rref_id`` of ``owner`` (kept in the owner's table)."""
        rref = cls.__new__(cls)
        rref._owner, rref._id, rref._value, rref._created = owner, rref_id, _NO_VALUE, created
        return rref

    def owner(self):
        return WorkerInfo(_require_agent().names[self._owner], self._owner)

    def owner_name(self):
        return self.owner().name

    def is_owner(self):
        return _require_agent().rank == self._owner

    def local_value(self):
        if not self.is_owner():
            me, owner = get_worker_info(), self.owner()
            raise RuntimeError(
                f"For {self!r}, can't call localValue() on user WorkerInfo(id={me.id}, "
                f"name={me.name}). Call it on owner WorkerInfo(id={owner.id}, name={owner.name}): "
                f"local_value() on rank {me.id}: this RRef is owned by rank {owner.id}; use "
                f"to_here()")
        if self._value is not _NO_VALUE:
            return self._value
        return _owned_value(self._id, _timeout_of(None))

    def _get_future(self):
        """As PyTorch's: a future completed when the value exists on the owner (its error, if
        creating it failed)."""
        if self._created is None:
            done = RpcFuture("RRef value")
            done.set_result(None)
            return done
        return self._created.then(_no_value)

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """The value, copied from the owner (the owner's own value, on the owner)."""
        timeout = _timeout_of(timeout, "RRef.to_here")
        if self._created is not None:
            self._created.wait(timeout or None)  # the remote() call's own error surfaces here
        if self.is_owner():
            return self.local_value()
        return _call(self._owner, "fetch", self._id, timeout).wait()

    # As PyTorch's: ``rref.rpc_sync().f(*args)`` runs ``f`` on the owner, the value as self.
    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy whose method calls run on the owner (the value as ``self``) and return the
        result: ``rref.rpc_sync().forward(x)``. ``timeout`` as rpc_sync's."""
        return RRefProxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy whose method calls run on the owner and return a Future of the result:
        ``rref.rpc_async().forward(x).wait()``. ``timeout`` as rpc_async's."""
        return RRefProxy(self, rpc_async, timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy whose method calls run on the owner and return an RRef to the result, kept
        there: ``rref.remote().forward(x).to_here()``. ``timeout`` as remote's."""
        return RRefProxy(self, remote, timeout)

    def __reduce__(self):
        """One more user at the owner, before the message carrying this copy leaves."""
        agent = _require_agent()
        if self._owner == agent.rank:
            _add_users(self._id, 1, self._value)
        else:  # ordered after this rank's remote() request, so counted after its creation
            _call(self._owner, "fork", self._id, _timeout_of(None)).wait()
        return (_rref_handle, (self._owner, self._id))

    def __del__(self):
        try:
            agent = _agent
        except NameError:  # module globals already gone at interpreter exit
            return
        if self._value is not _NO_VALUE or agent is None:
            return
        owner, rref_id = self._owner, self._id
        agent.call_soon(lambda: _forget(agent, owner, rref_id))

    def __repr__(self):
        return f"RRef(owner=rank {self._owner}, id={self._id})"


# Note [RRef proxies]
#     ``rref.rpc_sync().f(*args)`` (and ``rpc_async()``, ``remote()``) sends ``_invoke_on_owner``
#     to the owner, which calls ``f`` on its value, as PyTorch's rref_proxy.py. PyTorch sends the
#     RRef itself; pickling a handle costs a "fork" round trip to the owner first (Note [RRef
#     reference counting]), which would make every ``rpc_async().forward(x)`` of a pipeline
#     block for one. So a handle travels as its id, and the caller keeps the handle until the
#     reply has arrived (``_call(keep=)``): its "forget" cannot reach the owner before the call
#     has used the value. Only the owner's own call sends the RRef (pickled locally, for free).
#     Under ``init_rpc(allowed=...)`` ``_invoke_on_owner`` is a built-in global, so it checks the
#     policy itself: the value's class must be allowed, and the method's name public. A method
#     decorated with ``@rpc.functions.async_execution`` (read on the owner, through the bound,
#     static or class method) is replied to when its Future completes (Note [Async execution]
#     in functions.py): ``_invoke_on_owner`` hands the serving code that Future.
class RRefProxy:
    """What ``RRef.rpc_sync()``/``rpc_async()``/``remote()`` return: any method called on it
    runs on the RRef's owner with the owner's value as ``self``, through that RPC API."""

    def __init__(self, rref, rpc_api, timeout=UNSET_RPC_TIMEOUT):
        self.rref, self.rpc_api, self.rpc_timeout = rref, rpc_api, timeout

    def __getattr__(self, func_name):
        if func_name in ("rref", "rpc_api", "rpc_timeout"):  # not set yet (copy, unpickling)
            raise AttributeError(func_name)
        return functools.partial(_invoke_rpc, self.rref, self.rpc_api, func_name,
                                 self.rpc_timeout)

    def __repr__(self):
        return f"RRefProxy({self.rref!r}, {self.rpc_api.__name__})"


def _invoke_rpc(rref, rpc_api, func_name, timeout, *args, **kwargs):
    """Call ``func_name`` of ``rref``'s value on its owner, as ``rpc_api`` would (Note [RRef
    proxies]); ``func_name`` may also be a module-level function, called with the value first."""
    name = func_name if isinstance(func_name, str) else func_name.__name__
    what = f"RRef.{rpc_api.__name__}().{name}"
    timeout = _timeout_of(timeout, what)
    if rref.is_owner():
        target, keep = rref, ()
    else:
        target, keep = rref._id, (rref,)
    call = (target, func_name, args, kwargs)
    if rpc_api is remote:
        return _remote(rref._owner, _invoke_on_owner, call, None, timeout, keep, what)
    future = _call(rref._owner, "call", (_invoke_on_owner, call, {}), timeout, keep, what)
    return future if rpc_api is rpc_async else future.wait()


def _invoke_on_owner(target, func_name, args, kwargs):
    """On the owner: ``func_name`` of the value that ``target`` (an RRef, or an id the caller
    holds a handle to) refers to, called with ``args`` and ``kwargs``; or, when ``func_name`` is
    a function (unpickled under the rank's policy as any), ``func_name(value, *args, **kwargs)``."""
    if isinstance(target, RRef):
        value = target.local_value()
    else:
        value = _owned_value(target, _timeout_of(None))
    if not isinstance(func_name, str):
        result = func_name(value, *args, **kwargs)
        if functions.is_async(func_name):  # Note [Async execution]
            return functions.AsyncResult(functions.checked_future(func_name, result))
        return result
    policy = _require_agent().allowed
    if policy is not None:
        cls = type(value)
        if func_name.startswith("_") or not policy.permits(cls.__module__, cls.__qualname__):
            raise PermissionError(
                f"{policy.where} refuses the RRef proxy call {cls.__qualname__}.{func_name}: "
                f"under allowed=..., a proxy may call public methods of allowed classes only; "
                f"add {cls.__module__}.{cls.__qualname__} (or its module prefix) to allowed")
    method = getattr(value, func_name)
    result = method(*args, **kwargs)
    if functions.is_async(method):  # the owner replies when it completes: Note [Async execution]
        return functions.AsyncResult(functions.checked_future(method, result))
    return result


def _add_users(rref_id, delta, value=_NO_VALUE):
    """Count ``delta`` handles to ``rref_id`` on its owner (storing ``value`` when given); the
    value goes once none is left."""
    with _rref_created:
        users = _rref_users.get(rref_id, 0) + delta
        if users == 0:
            _rref_users.pop(rref_id, None)
            _rrefs.pop(rref_id, None)
            return
        _rref_users[rref_id] = users
        if value is not _NO_VALUE and users > 0:
            _rrefs[rref_id] = value
            _rref_created.notify_all()


def _forget(agent, owner, rref_id):
    """On the progress thread: one handle to ``rref_id`` is gone."""
    if owner == agent.rank:
        _add_users(rref_id, -1)
    elif owner not in agent.dead:  # a dead owner's values died with it
        try:
            agent.send(owner, "forget", rref_id=rref_id)
        except (ProcessFailure, AgentShutDown):  # (after shutdown the owner drops every value)
            pass


def _serve_fork(src, envelope, payloads):
    _add_users(_decode(envelope["body"], payloads, src), 1)
    body, out = _encode(None, src)
    _require_agent().reply(src, envelope["id"], "result", body, out)


def _serve_forget(src, envelope, payloads):
    _add_users(envelope["rref_id"], -1)


def _no_value(future):
    future.value()  # raises the error the future completed with


def _rref_handle(owner, rref_id):
    return RRef._handle(owner, rref_id)


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Run ``func`` on ``to`` and keep the result there; returns an RRef to it at once."""
    return _remote(to, func, args, kwargs, _timeout_of(timeout, "remote"))


def _remote(to, func, args, kwargs, timeout, keep=(), name=None):
    agent = _require_agent()
    dst = _rank_of(to)
    rref_id = (agent.rank << 40) | next(_rref_ids)
    created = _call(dst, "remote", (func, tuple(args or ()), dict(kwargs or {}), rref_id), timeout,
                    keep, name)
    return RRef._handle(dst, rref_id, created)  # errors surface on to_here()


def _serve_remote(src, envelope, payloads):
    agent = _require_agent()
    try:
        with _codec.serving(envelope):
            func, args, kwargs, rref_id = _decode(envelope["body"], payloads, src)
            try:
                value = func(*args, **kwargs)
                future = functions.future_of(func, value)
            except BaseException as exc:
                value, future = _Failed(exc), None
            if future is not None:  # Note [Async execution]: the value is the future's
                _reply_when_done(agent, src, envelope, future,
                                 f"a remote() call from rank {src}", rref_id)
                return
            _add_users(rref_id, 1, value)  # its creator's handle
            if isinstance(value, _Failed):
                raise value.error
            body, out = _encode(None, src)
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error",
                    **error_fields(exc, f"a remote() call from rank {src}"))


def _serve_fetch(src, envelope, payloads):
    agent = _require_agent()
    try:
        with _codec.serving(envelope):
            value = _owned_value(_decode(envelope["body"], payloads, src), _timeout_of(None))
            body, out = _encode(value, src)
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error",
                    **error_fields(exc, f"an RRef fetch from rank {src}"))


class _Failed:
    """What an RRef holds when its remote() call raised."""

    def __init__(self, error):
        self.error = error


def _owned_value(rref_id, timeout):
    with _rref_created:
        if not _rref_created.wait_for(lambda: rref_id in _rrefs, timeout or None):
            raise RpcTimeoutError(f"RRef {rref_id}: its value was not created on the owner "
                                  f"(rank {_require_agent().rank}) within {timeout:g} s")
        value = _rrefs[rref_id]
    if isinstance(value, _Failed):
        raise value.error
    return value
