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
"""

import contextlib
import itertools
import queue
import threading

from ...tensor import Tensor
from .context import container, current_context_id, set_current
from .engine import dist_engine
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
    container.release(envelope["context_id"])


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
    """On the receiver: ``tensor`` becomes the output of a RecvRpcBackward toward ``src``."""
    context_id, message_id = ids
    ctx = container.get_or_create(context_id)
    ctx.known_workers.add(src)
    fn = RecvRpcBackward(ctx, message_id, src, tensor, _send_grad)
    ctx.add_recv_function(message_id, fn)
    tensor.requires_grad, tensor.grad_fn, tensor._output_nr = True, fn, 0
    return tensor


def note_peer(dst):
    """Remember that the current context reached ``dst`` (it must release the context too)."""
    context_id = current_context_id()
    if context_id is not None:
        container.retrieve(context_id).known_workers.add(dst)


def _send_grad(peer, context_id, message_id, array):
    agent = _require_agent()
    return agent.request(peer, "backward", payloads=[array], context_id=context_id,
                         message_id=message_id,
                         describe=f"backward to rank {peer} (context {context_id})")


# --- backward -----------------------------------------------------------------------------------
def backward(context_id, roots, retain_graph=False, timeout=DEFAULT_TIMEOUT):
    """Backward from scalar ``roots`` through every rank the context reached.

    Gradients of leaves are accumulated in the context (``get_gradients``) on each rank.
    Returns when this rank's graph and every rank it sent gradients to are done; an error on
    any rank is raised here as "Error on Node N: ...".
    """
    _require_agent()
    ctx = container.retrieve(context_id)
    dist_engine.execute(ctx, list(roots), retain_graph, lambda c: _wait_outstanding(c, timeout))


def _wait_outstanding(ctx, timeout):
    for future in ctx.take_outstanding():
        future.wait(timeout)
        envelope, _ = future.value()
        if envelope["kind"] == "error":
            raise RuntimeError(envelope["error"])


def _serve_backward(src, envelope, payloads):
    agent = _require_agent()
    ctx_id = envelope["context_id"]

    def on_done(error):
        if error is None:
            agent.reply(src, envelope["id"], "done")
        else:
            text = str(error) if str(error).startswith("Error on Node") else \
                f"Error on Node {agent.rank}: {type(error).__name__}: {error}"
            agent.reply(src, envelope["id"], "error", error=text)

    try:
        ctx = container.retrieve(ctx_id)
        send_function = ctx.send_functions[envelope["message_id"]]
        send_function.grads = [Tensor._make(payloads[0], False, None, 0)]
        with context_guard(ctx_id):
            dist_engine.execute_send_function(ctx, send_function, False, on_done)
    except BaseException as exc:
        on_done(exc)


def wait_for_backward(context_id, timeout=DEFAULT_TIMEOUT):
    """On a rank that did not call backward: wait until the pass has finished its part here."""
    if not container.retrieve(context_id).backward_done.wait(timeout):
        raise TimeoutError(f"no backward pass finished on this rank for context {context_id} "
                           f"within {timeout:g} s")


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
    """The next tensor ``send`` by rank ``src`` (its backward returns the gradient to ``src``)."""
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
