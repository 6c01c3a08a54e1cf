"""torch.distributed.autograd on MPI: contexts, backward across ranks, and SPMD send/recv.

    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", model_part, args=(x,)).sum()
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)   # {tensor: gradient}; .grad is untouched

Every tensor that requires grad and crosses ranks inside a context (RPC arguments, results,
or ``send``/``recv``) gets a SendRpcBackward on the sender and a RecvRpcBackward on the
receiver, registered in the context under one message id; backward follows them back.
All send/recv functions of a context are assumed to take part in its backward (PyTorch's
FAST mode).

SPMD pipelines use ``send``/``recv`` instead of RPC: every rank opens its own context; a tensor
received inside a context joins that context, and its gradient goes back to the sender's.

    with dist_autograd.context() as ctx:            # on every rank
        h = x if rank == 0 else dist_autograd.recv(rank - 1)
        h = stage(h)
        if rank < last:
            dist_autograd.send(h, rank + 1)
            dist_autograd.wait_for_backward(ctx)    # until the gradients came back through here
        else:
            dist_autograd.backward(ctx, [loss_fn(h)])
        grads = dist_autograd.get_gradients(ctx)
"""

import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time

from ...tensor import Tensor
from ..rpc.agent import RpcError, RpcFuture, RpcTimeoutError
from .context import container, current_context_id, set_current
from .engine import dist_engine, fail_graph_task
from .functions import RecvRpcBackward, SendRpcBackward

_agent = None
_message_ids = itertools.count(1)
_inbox = {}  # src rank -> queue of SPMD send() messages
_inbox_lock = threading.Lock()
DEFAULT_TIMEOUT = 60.0


def _require_agent():
    if _agent is None:
        raise RuntimeError("distributed autograd needs RPC: call "
                           "hpcgrad.distributed.rpc.init_rpc(name) on every rank first")
    return _agent


def _install(agent):
    """Called by init_rpc: the backward pass rides on the RPC agent."""
    global _agent
    _agent = agent
    container.rank = agent.rank
    agent.register_handler("backward", _serve_backward)
    agent.register_handler("release", _serve_release, inline=True)
    agent.register_handler("p2p", _serve_p2p, inline=True)  # arrival order is recv() order


def _uninstall():
    """Called by rpc.shutdown."""
    global _agent
    _agent = None


# --- contexts ---------------------------------------------------------------------------------
@contextlib.contextmanager
def context():
    """A new autograd context; yields its id (unique across ranks). Released on exit, everywhere."""
    ctx = container.new_context()
    previous = set_current(ctx.context_id)
    try:
        yield ctx.context_id
    finally:
        set_current(previous)
        _release(ctx.context_id)


def _release(context_id):
    ctx = container.release(context_id)
    if ctx is None or _agent is None:
        return
    for worker in sorted(ctx.known_workers):
        if worker != _agent.rank:
            _agent.send(worker, "release", context_id=context_id)


def _serve_release(src, envelope, payloads):
    """Release here, and on every rank this one reached in the context (nested RPCs)."""
    ctx = container.release(envelope["context_id"])
    if ctx is None:
        return
    for worker in sorted(ctx.known_workers - {src, _agent.rank}):
        _agent.send(worker, "release", context_id=ctx.context_id)


@contextlib.contextmanager
def context_guard(context_id):
    """Run with ``context_id`` (created if new on this rank) as the current context."""
    if context_id is None:
        yield None
        return
    container.get_or_create(context_id)
    previous = set_current(context_id)
    try:
        yield context_id
    finally:
        set_current(previous)


def get_gradients(context_id):
    """{tensor: gradient} accumulated in this context on this rank."""
    return container.retrieve(context_id).gradients()


def _get_debug_info():
    return {"num_current_backward_passes": dist_engine.num_backward_passes(),
            "num_autograd_contexts": len(container)}


# --- tensors crossing ranks ----------------------------------------------------------------------
def attach_send(tensor):
    """On the sender: a SendRpcBackward for ``tensor`` in the current context (None outside)."""
    context_id = current_context_id()
    if context_id is None:
        return None
    ctx = container.retrieve(context_id)
    message_id = (container.rank << 48) | next(_message_ids)
    ctx.add_send_function(message_id, SendRpcBackward(tensor._gradient_edge()))
    return (context_id, message_id)


def attach_recv(tensor, ids, src):
    """On the receiver: ``tensor`` becomes the output of a RecvRpcBackward toward ``src``.

    It joins the current context (an RPC runs in its caller's; an SPMD rank in its own), or,
    on a thread without one (an RPC result arriving), the sender's context.
    """
    peer_context_id, message_id = ids
    current = current_context_id()
    ctx = container.get_or_create(peer_context_id if current is None else current)
    ctx.known_workers.add(src)
    fn = RecvRpcBackward(ctx, peer_context_id, message_id, src, tensor, _send_grad)
    ctx.add_recv_function(message_id, fn)
    tensor.requires_grad, tensor.grad_fn, tensor._output_nr = True, fn, 0
    return tensor


def note_peer(dst):
    """Remember that the current context reached ``dst`` (it must release the context too)."""
    context_id = current_context_id()
    if context_id is not None:
        container.retrieve(context_id).known_workers.add(dst)


def _send_grad(node, graph_task, array):
    """RecvRpcBackward's gradient to its sender: an outstanding RPC of the running pass.

    A failed or expired reply fails the running graph task at once (as PyTorch does), so no
    rank waits for send functions that will never run.
    """
    agent = _require_agent()
    ctx = getattr(graph_task, "dist_context", None) or node.context
    from ..rpc.message import _host  # gradients are often broadcast views (strides 0)
    reply = agent.request(node.peer, "backward", payloads=[_host(array)],
                          context_id=node.peer_context_id, message_id=node.message_id,
                          timeout=ctx.timeout, pass_timeout=ctx.timeout,
                          describe=f"backward to rank {node.peer} (context "
                                   f"{node.peer_context_id})")
    result = RpcFuture(reply.describe, ctx.timeout)
    result.message_id = reply.message_id  # cancel() forgets the request

    def check(future):
        try:
            envelope, _ = future.value()
            if envelope["kind"] == "error":
                raise RpcError(envelope["error"])
            result.set_result(None)
        except BaseException as exc:  # noqa: BLE001  (goes to the graph task and the waiter)
            result.set_exception(exc)
            if graph_task is not None:
                fail_graph_task(graph_task, exc)

    reply.add_done_callback(check)
    ctx.add_outstanding(result)


# --- backward -----------------------------------------------------------------------------------
def backward(context_id, roots, retain_graph=False, timeout=DEFAULT_TIMEOUT):
    """Backward from scalar ``roots`` through every rank the context reached.

    Gradients of leaves are accumulated in the context (``get_gradients``) on each rank.
    Returns when this rank's graph and every rank it sent gradients to are done; an error on
    any rank is raised here as "Error on Node N: ..."; past ``timeout`` seconds (None: never)
    an RpcTimeoutError names the rank still owing an answer. A context whose pass failed
    refuses further gradients: use a fresh context.
    """
    _require_agent()
    ctx = container.retrieve(context_id)
    ctx.timeout, ctx.abandoned = timeout, False
    dist_engine.execute(ctx, list(roots), retain_graph, lambda c: _wait_for_pass(c, timeout))


def _wait_for_pass(ctx, timeout):
    """The local graph (its send functions wait for other ranks), then every gradient sent on."""
    deadline = time.monotonic() + timeout if timeout else None

    def left():
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    pending = []
    try:
        try:
            ctx.graph_task.future.result(left())
        except concurrent.futures.TimeoutError:
            raise _pass_timeout(ctx, ctx.take_outstanding(), timeout) from None
        except BaseException as exc:
            raise _node_error(exc) from exc
        pending = ctx.take_outstanding()
        for i, future in enumerate(pending):
            try:
                future.wait(left())
            except RpcTimeoutError:
                raise _pass_timeout(ctx, pending[i:], timeout) from None
    except BaseException:
        ctx.abandoned = True
        error = RpcError(f"backward pass in context {ctx.context_id} was abandoned")
        for future in pending + ctx.take_outstanding():
            _agent.cancel(future, error)
        raise


def _pass_timeout(ctx, outstanding, timeout):
    waiting = [f for f in outstanding if not f.done() or f.exception() is not None]
    for f in outstanding:
        _agent.cancel(f, RpcError(f"backward pass in context {ctx.context_id} timed out"))
    what = (waiting[0].describe if waiting else
            f"backward in context {ctx.context_id} (waiting for gradients from other ranks)")
    return RpcTimeoutError(f"dist_autograd.backward: {what} timed out after {timeout:g} s")


def _node_error(exc):
    """``exc`` as "Error on Node N: ..." (N: where it was raised; remote errors already are)."""
    text = str(exc)
    kind = RpcTimeoutError if isinstance(exc, TimeoutError) else RpcError
    if isinstance(exc, RpcError) and text.startswith("Error on Node"):
        return kind(text)
    notes = "".join(f" {n}" for n in getattr(exc, "__notes__", ()))
    return kind(f"Error on Node {_agent.rank}: {type(exc).__name__}: {text}{notes}")


def _serve_backward(src, envelope, payloads):
    agent = _require_agent()
    ctx_id = envelope["context_id"]

    def on_done(error):
        if error is None:
            agent.reply(src, envelope["id"], "done")
        else:
            agent.reply(src, envelope["id"], "error", error=str(_node_error(error)))

    try:
        ctx = container.retrieve(ctx_id)
        if ctx.abandoned:
            raise RuntimeError(f"a backward pass in context {ctx_id} failed or timed out on "
                               "this rank earlier; run backward in a fresh context")
        ctx.timeout = envelope.get("pass_timeout")  # bounds the gradients this rank sends on
        send_function = ctx.send_functions[envelope["message_id"]]
        send_function.grads = [Tensor._make(payloads[0], False, None, 0)]
        with context_guard(ctx_id):
            dist_engine.execute_send_function(ctx, send_function, False, on_done)
    except BaseException as exc:  # noqa: BLE001  (answered to the peer)
        on_done(exc)


def wait_for_backward(context_id, timeout=DEFAULT_TIMEOUT):
    """On a rank that did not call backward: wait until the pass has finished its part here
    (its local graph and every gradient it sent on); raises the error if that part failed."""
    ctx = container.retrieve(context_id)
    if not ctx.backward_done.wait(timeout):
        raise RpcTimeoutError(f"wait_for_backward: no backward pass reached this rank in "
                              f"context {context_id} within {timeout:g} s")
    if ctx.backward_error is not None:
        raise _node_error(ctx.backward_error)


# --- SPMD point to point --------------------------------------------------------------------------
def send(tensor, dst):
    """Send ``tensor`` to rank ``dst``; inside a context its gradient will come back here."""
    agent = _require_agent()
    if dst == agent.rank:
        raise ValueError("send to self would deadlock; use the tensor directly")
    from ..rpc import message
    body, payloads = message.encode(tensor, attach_send)
    note_peer(dst)
    agent.send(dst, "p2p", body, payloads)


def recv(src, timeout=DEFAULT_TIMEOUT):
    """The next tensor ``send`` by rank ``src``; inside a context it joins that context, and
    backward returns its gradient to ``src``."""
    agent = _require_agent()
    if src == agent.rank:
        raise ValueError("receive from self would deadlock")
    try:
        envelope, payloads = _inbox_of(src).get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"recv(src={src}): nothing arrived within {timeout:g} s") from None
    from ..rpc import message
    return message.decode(envelope["body"], payloads, lambda t, ids: attach_recv(t, ids, src))


def _inbox_of(src):
    with _inbox_lock:
        return _inbox.setdefault(src, queue.Queue())


def _serve_p2p(src, envelope, payloads):
    _inbox_of(src).put((envelope, payloads))
