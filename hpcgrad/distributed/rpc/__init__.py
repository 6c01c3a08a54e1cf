"""torch.distributed.rpc on MPI: init_rpc, rpc_sync, rpc_async, remote/RRef, shutdown.

Functions run on the callee's pool threads; a remote exception is raised in the caller with
the remote rank and traceback. Inside ``hpcgrad.distributed.autograd.context()``, tensors that
require grad carry the backward across ranks (see hpcgrad/distributed/autograd).
"""

import collections
import itertools
import threading
import traceback

from ...mpi import comm_world
from . import message
from .agent import MPIRpcAgent, RpcError, RpcFuture, RpcTimeoutError  # noqa: F401

DEFAULT_RPC_TIMEOUT = 60.0

WorkerInfo = collections.namedtuple("WorkerInfo", ["name", "id"])
_agent = None
_rrefs = {}            # rref id -> value, on the owner
_rref_lock = threading.Lock()
_rref_created = threading.Condition(_rref_lock)  # a fetch may arrive before its remote() ran
_rref_ids = itertools.count(1)


def _require_agent():
    if _agent is None:
        raise RuntimeError("RPC has not been initialized. Call "
                           "hpcgrad.distributed.rpc.init_rpc(name) on every rank first.")
    return _agent


def init_rpc(name, rank=None, world_size=None, num_worker_threads=8):
    """Start this rank's agent. Every rank calls it (collective); names must be unique."""
    global _agent
    if _agent is not None:
        raise RuntimeError("init_rpc was already called on this rank; call shutdown() first")
    comm = comm_world()
    if rank is not None and rank != comm.Get_rank():
        raise ValueError(f"rank={rank} but this process is MPI rank {comm.Get_rank()}: under "
                         "mpiexec the MPI rank is the RPC rank (leave rank out)")
    if world_size is not None and world_size != comm.Get_size():
        raise ValueError(f"world_size={world_size} but the MPI job has {comm.Get_size()} ranks")
    _agent = MPIRpcAgent(name, comm, num_worker_threads)
    for kind, handler in (("call", _serve_call), ("remote", _serve_remote),
                          ("fetch", _serve_fetch), ("forget", _serve_forget)):
        _agent.register_handler(kind, handler)
    from ..autograd import _install  # the backward pass rides on the same agent
    _install(_agent)
    _agent.start()  # only now: a request arriving earlier would find no handler
    return _agent


def shutdown(graceful=True, timeout=DEFAULT_RPC_TIMEOUT):
    """Stop the agent. ``graceful``: every rank first reaches shutdown (serving until then)."""
    global _agent
    agent = _require_agent()
    if graceful:
        agent.join(timeout)
    agent.fail_pending(RpcError("RPC agent shut down before the reply arrived"))
    agent.stop()
    _agent = None
    from ..autograd import _uninstall
    _uninstall()
    with _rref_lock:
        _rrefs.clear()


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
    if isinstance(to, int):
        if not 0 <= to < agent.size:
            raise ValueError(f"no worker with rank {to} (world size {agent.size})")
        return to
    if to not in agent.names:
        raise ValueError(f"unknown worker {to!r}; workers are {agent.names}")
    return agent.names.index(to)


# --- calls ------------------------------------------------------------------------------------
def _encode(obj):
    from ..autograd import attach_send
    return message.encode(obj, attach_send)


def _decode(body, payloads, src):
    from ..autograd import attach_recv
    return message.decode(body, payloads, lambda t, ids: attach_recv(t, ids, src))


def _context_fields():
    from ..autograd import current_context_id
    ctx = current_context_id()
    return {} if ctx is None else {"ctx": ctx}


def rpc_async(to, func, args=None, kwargs=None, timeout=DEFAULT_RPC_TIMEOUT):
    """Run ``func(*args, **kwargs)`` on worker ``to``; returns a future of its result."""
    return _call(to, "call", (func, tuple(args or ()), dict(kwargs or {})), timeout)


def rpc_sync(to, func, args=None, kwargs=None, timeout=DEFAULT_RPC_TIMEOUT):
    """``rpc_async(...).wait()``: blocks until the result arrives, or raises past ``timeout``."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def _call(to, kind, obj, timeout):
    agent = _require_agent()
    dst = _rank_of(to)
    body, payloads = _encode(obj)
    from ..autograd import note_peer
    note_peer(dst)
    name = getattr(obj[0], "__qualname__", kind) if kind in ("call", "remote") else kind
    reply = agent.request(dst, kind, body, payloads,
                          describe=f"RPC {name} to {agent.names[dst]} (rank {dst})",
                          timeout=timeout, **_context_fields())
    result = RpcFuture(reply.describe, timeout)

    def unpack(fut):
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


def error_fields(exc):
    agent = _require_agent()
    return dict(error=str(exc), error_type=type(exc).__name__,
                traceback="".join(traceback.format_exception(exc)),
                worker=agent.name, rank=agent.rank)


def _run_in_context(envelope, fn):
    from ..autograd import context_guard
    with context_guard(envelope.get("ctx")):
        return fn()


def _serve_call(src, envelope, payloads):
    agent = _require_agent()
    try:
        def run():
            func, args, kwargs = _decode(envelope["body"], payloads, src)
            return _encode(func(*args, **kwargs))
        body, out = _run_in_context(envelope, run)
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error", **error_fields(exc))


# --- remote references --------------------------------------------------------------------------
class RRef:
    """A reference to a value that lives on its owner."""

    def __init__(self, owner, rref_id, value=None, local=False):
        self._owner, self._id = owner, rref_id
        if local:
            with _rref_lock:
                _rrefs[rref_id] = value

    def owner(self):
        return WorkerInfo(_require_agent().names[self._owner], self._owner)

    def owner_name(self):
        return self.owner().name

    def is_owner(self):
        return _require_agent().rank == self._owner

    def local_value(self):
        if not self.is_owner():
            raise RuntimeError(f"local_value() on rank {_require_agent().rank}: this RRef is owned "
                               f"by rank {self._owner}; use to_here()")
        return _owned_value(self._id, DEFAULT_RPC_TIMEOUT)

    def to_here(self, timeout=DEFAULT_RPC_TIMEOUT):
        """The value, copied from the owner (the owner's own value, on the owner)."""
        created = getattr(self, "_created", None)
        if created is not None:
            created.wait(timeout or None)  # the remote() call's own error surfaces here
        if self.is_owner():
            return self.local_value()
        return _call(self._owner, "fetch", self._id, timeout).wait()

    def __getstate__(self):
        return (self._owner, self._id)

    def __setstate__(self, state):
        self._owner, self._id = state

    def __repr__(self):
        return f"RRef(owner=rank {self._owner}, id={self._id})"


def remote(to, func, args=None, kwargs=None, timeout=DEFAULT_RPC_TIMEOUT):
    """Run ``func`` on ``to`` and keep the result there; returns an RRef to it at once."""
    agent = _require_agent()
    dst = _rank_of(to)
    rref_id = (agent.rank << 40) | next(_rref_ids)
    rref = RRef(dst, rref_id)
    created = _call(dst, "remote", (func, tuple(args or ()), dict(kwargs or {}), rref_id), timeout)
    rref._created = created  # errors surface on to_here()/wait of this future
    return rref


def _serve_remote(src, envelope, payloads):
    agent = _require_agent()
    try:
        def run():
            func, args, kwargs, rref_id = _decode(envelope["body"], payloads, src)
            try:
                value = func(*args, **kwargs)
            except BaseException as exc:
                value = _Failed(exc)
            with _rref_created:
                _rrefs[rref_id] = value
                _rref_created.notify_all()
            if isinstance(value, _Failed):
                raise value.error
            return _encode(None)
        body, out = _run_in_context(envelope, run)
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error", **error_fields(exc))


def _serve_fetch(src, envelope, payloads):
    agent = _require_agent()
    try:
        value = _owned_value(_decode(envelope["body"], payloads, src), DEFAULT_RPC_TIMEOUT)
        body, out = _run_in_context(envelope, lambda: _encode(value))
        agent.reply(src, envelope["id"], "result", body, out)
    except BaseException as exc:
        agent.reply(src, envelope["id"], "error", **error_fields(exc))


class _Failed:
    """What an RRef holds when its remote() call raised."""

    def __init__(self, error):
        self.error = error


def _owned_value(rref_id, timeout):
    with _rref_created:
        if not _rref_created.wait_for(lambda: rref_id in _rrefs, timeout):
            raise RpcTimeoutError(f"RRef {rref_id}: its value was not created on the owner "
                                  f"(rank {_require_agent().rank}) within {timeout:g} s")
        value = _rrefs[rref_id]
    if isinstance(value, _Failed):
        raise value.error
    return value


def _serve_forget(src, envelope, payloads):
    with _rref_lock:
        _rrefs.pop(_decode(envelope["body"], payloads, src), None)
