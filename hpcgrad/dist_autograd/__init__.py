"""torch.distributed.autograd on MPI: contexts, backward across ranks, and SPMD send/recv.

    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", model_part, args=(x,)).sum()
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)   # {tensor: gradient}; .grad is untouched

Every message that carries tensors requiring grad across ranks inside a context (RPC
arguments, results, or ``send``/``recv``) gets one SendRpcBackward on the sender and one
RecvRpcBackward on the receiver, registered in the context under one message id; backward
follows them back. All send/recv functions of a context are assumed to take part in its
backward (PyTorch's FAST mode). This package rides on RPC through its codec (Note [RPC codec]
in hpcgrad/rpc/__init__.py), registered when it is imported.

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

import contextlib
import itertools
import numbers
import queue
import threading
import time

from hpcgrad.base.futures import Future, FutureTimeoutError
from hpcgrad.comm.ulfm import ProcessFailure
from hpcgrad.tensor._tensor import Tensor
from hpcgrad import rpc
from hpcgrad.rpc import message
from hpcgrad.rpc.agent import RpcError, RpcFuture, RpcTimeoutError, run_here_later
from hpcgrad.dist_autograd.context import PassState, container, current_context_id, set_current
from hpcgrad.dist_autograd.engine import dist_engine
from hpcgrad.dist_autograd.functions import RecvRpcBackward, SendRpcBackward

_agent = None
_message_ids = itertools.count(1)
_pass_ids = itertools.count(1)
_inbox = {}  # src rank -> queue of SPMD send() messages
_inbox_lock = threading.Lock()
DEFAULT_TIMEOUT = 60.0


def _require_agent():
    if _agent is None:
        raise RuntimeError("distributed autograd needs RPC: call "
                           "hpcgrad.distributed.rpc.init_rpc(name) on every rank first")
    return _agent


class _AutogradCodec(rpc.Codec):
    """What distributed autograd adds to RPC messages (Note [RPC codec])."""

    def install(self, agent):
        global _agent
        _agent = agent
        container.rank = agent.rank
        agent.register_handler("backward", _serve_backward, inline=True)  # hands off itself
        agent.register_handler("release", _serve_release, inline=True)
        agent.register_handler("abort", _serve_abort, inline=True)
        agent.register_handler("p2p", _serve_p2p, inline=True)  # arrival order is recv() order
        agent.add_failure_listener(_workers_died)

    def uninstall(self):
        global _agent
        _agent = None
        container.clear()  # their peers are gone; a later init_rpc starts clean

    def request_fields(self, dst):
        """A request made inside a context runs in it on the callee (which must release it)."""
        context_id = current_context_id()
        ctx = None if context_id is None else container.find(context_id)
        if ctx is None:  # (or released while this thread served in it)
            return {}
        ctx.known_workers.add(dst)
        return {"ctx": context_id}

    def on_send(self, dst, tensors):
        return attach_send(tensors)

    def on_receive(self, src, tensors, metadata):
        attach_recv(tensors, metadata, src, own_context=False)

    def serving(self, envelope):
        return context_guard(envelope.get("ctx"))


# --- contexts ---------------------------------------------------------------------------------
@contextlib.contextmanager
def context():
    """A new autograd context; yields its id (unique across ranks). Released on exit, everywhere."""
    if current_context_id() is not None:
        raise RuntimeError(f"Already have an autograd context id for this thread (context "
                           f"{current_context_id()}); nested dist_autograd.context() blocks are "
                           "not supported: use one context per forward/backward")
    ctx = container.new_context()
    previous = set_current(ctx.context_id)
    try:
        yield ctx.context_id
    finally:
        set_current(previous)
        _release(ctx.context_id)


def _release(context_id, why=None):
    """Release here and, on their next message, on the ranks the context reached; ``why``:
    the ProcessFailure it is released for (Note [Contexts of a dead worker])."""
    ctx = container.release(context_id, why)
    if ctx is None:
        return
    _end_running_pass(ctx, f"context {context_id} was released", error=why)
    if _agent is None:
        return
    for worker in sorted(ctx.known_workers):
        if worker != _agent.rank:  # on the next message there: Note [Carried messages]
            _agent.carry(worker, "release", context_id=context_id)


def _serve_release(src, envelope, payloads):
    """Release here, and on every rank this one reached in the context (nested RPCs)."""
    ctx = container.release(envelope["context_id"])
    if ctx is None:
        return
    _end_running_pass(ctx, f"context {ctx.context_id} was released by rank {src}")
    for worker in sorted(ctx.known_workers - {src, _agent.rank}):
        _agent.carry(worker, "release", context_id=ctx.context_id)


def _end_running_pass(ctx, why, pass_id=None, error=None):
    """Fail the pass running in ``ctx`` (``pass_id``, or any): it answers and is cleaned up.
    ``error``: the error to fail it with (default: an RpcError saying ``why``)."""
    state = ctx.current_pass
    if state is None or (pass_id is not None and state.pass_id != pass_id):
        return
    if error is None:
        error = RpcError(f"backward pass {state.pass_id:#x} in context {ctx.context_id} ended "
                         f"on rank {container.rank}: {why}")
    state.graph_task.fail(error)
    for future in state.outstanding():
        _agent.cancel(future, error)


# Note [Contexts of a dead worker]
#     Under ULFM the RPC agent tells this module which ranks died (Note [RPC to a dead rank] in
#     rpc/agent.py). Every context here that reached one of them is of no further use: a
#     backward pass through it would wait for gradients that never come. So each is released
#     at once (on the ranks it reached too, as at a context's exit), and its pass, if one runs,
#     fails with the ProcessFailure naming the dead worker: ``backward`` raises it (as "Error on
#     Node N: ..."), a peer's ``wait_for_backward`` too, and so does any later use of the context
#     (``retrieve``: backward, get_gradients), instead of "Could not find autograd context".
#     ``recv`` from a dead rank raises it once the messages that rank sent before are taken.
def _workers_died(ranks):
    """The agent's failure listener: Note [Contexts of a dead worker]."""
    dead = set(ranks)
    for ctx in container.contexts():
        reached = sorted(ctx.known_workers & dead)
        if not reached:
            continue
        error = _agent.dead.error(reached[0], f"distributed autograd context {ctx.context_id} "
                                              f"reached it and was released")
        if not ctx.backward_done.is_set():
            ctx.signal_done(error)
        _release(ctx.context_id, error)
    for rank in ranks:
        _inbox_of(rank).put(_agent.dead.error(rank, f"recv(src={rank})"))


@contextlib.contextmanager
def context_guard(context_id):
    """Run with ``context_id`` (created if new on this rank) as the current context; outside
    any when it was released here already (Note [Released contexts stay released])."""
    if context_id is None or container.get_or_create(context_id) is None:
        yield None
        return
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
def attach_send(tensors):
    """On the sender of a message: one SendRpcBackward for its ``tensors`` in the current
    context; returns the ids its receiver needs (None outside a context)."""
    context_id = current_context_id()
    if context_id is None:
        return None
    ctx = container.find(context_id)
    if ctx is None:  # released while this thread served in it: Note [Released contexts stay released]
        return None
    message_id = (container.rank << 48) | next(_message_ids)
    ctx.add_send_function(message_id, SendRpcBackward([t._gradient_edge() for t in tensors]))
    return (context_id, message_id)


def attach_recv(tensors, ids, src, own_context=True):
    """On the receiver: ``tensors`` become the outputs of one RecvRpcBackward toward ``src``.

    With ``own_context`` (SPMD ``recv``) they join the current context (an SPMD rank's own),
    or, on a thread without one, the sender's. Without (RPC requests and replies) they join the
    sender's context, which is the one an RPC runs in on both sides: whichever thread decodes
    a reply (Note [Waiting threads receive] in rpc/agent.py) and whatever its own context is.
    """
    peer_context_id, message_id = ids
    current = current_context_id() if own_context else None
    ctx = container.get_or_create(peer_context_id if current is None else current)
    if ctx is None:  # a reply after its context was left: Note [Released contexts stay released]
        return
    ctx.known_workers.add(src)
    fn = RecvRpcBackward(ctx, peer_context_id, message_id, src, tensors, _send_grad)
    ctx.add_recv_function(message_id, fn)
    for i, t in enumerate(tensors):
        t.requires_grad, t.grad_fn, t._output_nr = True, fn, i


def note_peer(dst):
    """Remember that the current context reached ``dst`` (it must release the context too)."""
    context_id = current_context_id()
    ctx = None if context_id is None else container.find(context_id)
    if ctx is not None:
        ctx.known_workers.add(dst)


def _send_grad(node, graph_task, arrays):
    """RecvRpcBackward's gradients to their sender.

    They carry the pass id and retain_graph (the peer keeps its part of the graph for the next
    pass, as PyTorch's PropagateGradientsReq). Sent to the rank that called backward, into the
    context the pass runs in there, they need no answer: that rank's own graph task waits for
    them (Note [The distributed-autograd round trip]). Sent anywhere else they are an
    outstanding RPC of the running pass: a failed or expired answer fails the running graph
    task at once (as PyTorch does), so no rank waits for send functions that never run.
    """
    agent = _require_agent()
    state = None if graph_task is None else graph_task.attached
    if not isinstance(state, PassState):
        raise RuntimeError("RecvRpcBackward ran outside a distributed backward pass: use "
                           "dist_autograd.backward(context_id, roots) for tensors received "
                           "in a context")
    payloads = [message.host_array(a) for a in arrays]
    fields = dict(context_id=node.peer_context_id, message_id=node.message_id,
                  pass_id=state.pass_id, keep_graph=state.keep_graph,
                  pass_timeout=state.timeout, origin_ctx=state.origin_context_id)
    if node.peer == state.origin_rank and node.peer_context_id == state.origin_context_id:
        held = getattr(_held, "grads", None)
        if held is not None:  # sent when this run ends, maybe inside its "done"
            held.append((node.peer, fields, payloads))
        else:
            agent.send(node.peer, "backward", payloads=payloads, answer=False, **fields)
        return
    reply = agent.request(node.peer, "backward", payloads=payloads, timeout=state.timeout,
                          inline_reply=True,  # check() below is short and never blocks
                          describe=f"backward to rank {node.peer} (context "
                                   f"{node.peer_context_id})", **fields)
    result = RpcFuture(reply.describe, state.timeout, agent=agent)
    result.message_id = reply.message_id  # agent.cancel() forgets the request

    def check(future):
        try:
            envelope, payloads = future.value()
            if envelope["kind"] == "error":
                raise RpcError(envelope["error"])
            start = 0  # gradients for this rank that rode on the "done"
            for grad_fields, count in envelope.get("grads", ()):
                _serve_backward(node.peer, dict(grad_fields, answer=False),
                                payloads[start:start + count])
                start += count
            result.try_set_result(None)  # try: agent.cancel() may have failed it already
        except BaseException as exc:  # noqa: BLE001  (goes to the graph task and the waiter)
            result.try_set_exception(exc)
            graph_task.fail(exc)

    reply.add_done_callback(check)
    state.add_outstanding(result)


# --- backward -----------------------------------------------------------------------------------
def backward(context_id, roots, retain_graph=False, timeout=DEFAULT_TIMEOUT):
    """Backward from scalar ``roots`` through every rank the context reached.

    Gradients of leaves are accumulated in the context (``get_gradients``) on each rank.
    Returns when this rank's graph and every rank it sent gradients to are done; an error on
    any rank is raised here as "Error on Node N: ..."; past ``timeout`` seconds (None: never)
    an RpcTimeoutError names the rank still owing an answer. After a failed pass the same
    context can run backward again (with ``retain_graph=True`` on the failed one).
    """
    if not isinstance(context_id, numbers.Integral) or isinstance(context_id, bool):
        raise TypeError(f"backward(context_id, roots): context_id must be an int (from "
                        f"dist_autograd.context()), got {type(context_id).__name__}")
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"backward(context_id, roots): roots must be a list of Tensors, got "
                        f"{type(roots).__name__}")
    agent = _require_agent()
    ctx = container.retrieve(context_id)
    state = PassState(ctx, (agent.rank << 48) | next(_pass_ids), retain_graph, timeout,
                      origin_context_id=context_id, driver=queue.SimpleQueue())
    try:
        dist_engine.execute(state, list(roots), lambda s: _wait_for_pass(s, timeout))
    except BaseException as exc:
        _abort(ctx, state, exc)
        raise


def _abort(ctx, state, error):
    """The pass failed here: every rank it may have reached ends its part (Note in engine.py)."""
    if _agent is None or state.graph_task is None:
        return
    for worker in sorted(ctx.known_workers - {_agent.rank}):
        try:
            _agent.send(worker, "abort", context_id=ctx.context_id, pass_id=state.pass_id,
                        error=str(error))
        except ProcessFailure:  # a dead worker runs nothing any more
            continue


def _serve_abort(src, envelope, payloads):
    """End the pass here if it runs, and on the ranks this one reached; once per pass."""
    try:
        ctx = container.retrieve(envelope["context_id"])
    except RuntimeError:
        return
    pass_id = envelope["pass_id"]
    if not ctx.mark_aborted(pass_id):
        return
    _end_running_pass(ctx, f"rank {src} abandoned it ({envelope['error']})", pass_id)
    for worker in sorted(ctx.known_workers - {src, _agent.rank}):
        try:
            _agent.send(worker, "abort", **{k: envelope[k] for k in ("context_id", "pass_id",
                                                                     "error")})
        except ProcessFailure:
            continue


def _wait_for_pass(state, timeout):
    """The local graph (its send functions wait for other ranks), then every gradient sent on."""
    deadline = time.monotonic() + timeout if timeout else None

    def left():
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    pending = []
    try:
        try:  # this thread runs the gradients that come back: Note in engine.py
            dist_engine.drive(state, left, _agent.progress_until)
        except FutureTimeoutError:
            raise _pass_timeout(state, state.take_outstanding(), timeout) from None
        except BaseException as exc:
            raise _node_error(exc) from exc
        pending = state.take_outstanding()
        for i, future in enumerate(pending):
            try:
                future.wait(left())
            except RpcTimeoutError:
                raise _pass_timeout(state, pending[i:], timeout) from None
    except BaseException as exc:
        for future in pending + state.take_outstanding():
            _agent.cancel(future, RpcError(f"backward pass in context "
                                           f"{state.context.context_id} failed: {exc}"))
        raise


def _pass_timeout(state, outstanding, timeout):
    waiting = [f for f in outstanding if not f.done() or f.exception() is not None]
    for f in outstanding:
        _agent.cancel(f, RpcError(f"backward pass in context {state.context.context_id} "
                                  "timed out"))
    what = (waiting[0].describe if waiting else
            f"backward in context {state.context.context_id} (waiting for gradients from "
            "other ranks)")
    return RpcTimeoutError(f"dist_autograd.backward: {what} timed out after {timeout:g} s")


def _node_error(exc):
    """``exc`` as "Error on Node N: <message>" (N: where it was raised; remote errors already
    are), as PyTorch words it; the Node that raised follows in the note."""
    text = str(exc)
    if isinstance(exc, ProcessFailure):  # keeps its type: Note [Contexts of a dead worker]
        if not text.startswith("Error on Node"):
            text = f"Error on Node {container.rank}: {text}"
        return ProcessFailure(text, exc.lost, exc.error_class)
    kind = RpcTimeoutError if isinstance(exc, TimeoutError) else RpcError
    if isinstance(exc, RpcError) and text.startswith("Error on Node"):
        return kind(text)
    notes = "".join(f" {n}" for n in getattr(exc, "__notes__", ()))
    return kind(f"Error on Node {container.rank}: {text}{notes}")


def _serve_backward(src, envelope, payloads):
    """A gradient from ``src``, on the receiving thread: one for the pass this rank's backward()
    runs goes straight to that thread, any other to the engine's pool, where it runs its part
    of the pass (Note [The distributed-autograd round trip] in engine.py), or to the receiving
    thread itself once it has stopped receiving, if it serves (Note [Serving threads] in
    rpc/agent.py)."""
    answer = _Answer(src, envelope)
    try:
        ctx = container.retrieve(envelope["context_id"])
        running = ctx.current_pass
        if (running is None or running.driver is None
                or running.pass_id != envelope["pass_id"]):
            if not run_here_later(_run_backward, ctx, envelope, payloads, answer):
                dist_engine.submit(_run_backward, ctx, envelope, payloads, answer)
            return
        send_function = ctx.send_functions[envelope["message_id"]]
        send_function.set_grads(payloads, lambda a: Tensor._make(a, False, None, 0))
        answered = dist_engine.deliver(running, send_function)
    except BaseException as exc:  # noqa: BLE001  (answered to the peer)
        answered = Future()
        answered.set_exception(exc)
    answered.add_done_callback(answer)


class _Answer:
    """Answers a gradient message once this rank's part of its pass is done (or failed)."""

    def __init__(self, src, envelope):
        self.src, self.envelope = src, envelope
        self.wanted = envelope.get("answer", True)

    def __call__(self, future, held=()):
        """``held``: gradients for ``src`` (destination, fields, payloads) that ride along."""
        error = future.exception()
        if not self.wanted:
            if error is not None:  # the pass this gradient belongs to ends here with it
                _fail_running_pass(self.envelope, error)
        elif error is None:
            _agent.reply(self.src, self.envelope["id"], "done",
                         payloads=[a for _, _, arrays in held for a in arrays],
                         grads=[(fields, len(arrays)) for _, fields, arrays in held])
        else:
            _agent.reply(self.src, self.envelope["id"], "error",
                         error=str(_node_error(error)))


_held = threading.local()  # .grads: gradients for the origin held until a run ends (below)


def _run_backward(ctx, envelope, payloads, answer):
    """On the engine's pool: this rank's part of a pass, from one gradient of its peer.

    Gradients this run sends to the pass's origin are held until it ends: when the part is
    done by then (nothing outstanding) they ride inside the "done" answer to the same rank,
    else they leave on their own. The run waits for nothing outside this rank, so holding
    them cannot deadlock (Note [The distributed-autograd round trip] in engine.py)."""
    _held.grads = held = []
    try:
        send_function = ctx.send_functions[envelope["message_id"]]
        send_function.set_grads(payloads, lambda a: Tensor._make(a, False, None, 0))
        state = PassState(ctx, envelope["pass_id"], envelope["keep_graph"],
                          envelope.get("pass_timeout"), envelope.get("origin_ctx"))
        answered = dist_engine.execute_send_function(state, send_function, run_here=True)
    except BaseException as exc:  # noqa: BLE001  (answered to the peer)
        answered = Future()
        answered.set_exception(exc)
    finally:
        _held.grads = None
    if held:
        if (answer.wanted and answered.done() and answered.exception() is None
                and all(dst == answer.src for dst, _, _ in held)):
            answer(answered, held)
            return
        for dst, fields, arrays in held:
            _agent.send(dst, "backward", payloads=arrays, answer=False, **fields)
    answered.add_done_callback(answer)
    error = answered.exception() if answered.done() else None
    if (isinstance(error, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()):
        raise error  # Ctrl-C on a serving main thread: the peer has its answer; stop serving


def _fail_running_pass(envelope, error):
    """A gradient that needed no answer failed here: fail its pass if it still runs."""
    try:
        ctx = container.retrieve(envelope["context_id"])
    except RuntimeError:
        return
    state = ctx.current_pass
    if state is not None and state.pass_id == envelope["pass_id"] and state.graph_task:
        state.graph_task.fail(_node_error(error))


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
    body, payloads = message.encode(tensor, attach_send)
    note_peer(dst)
    agent.send(dst, "p2p", body, payloads)


def recv(src, timeout=DEFAULT_TIMEOUT):
    """The next tensor ``send`` by rank ``src``; inside a context it joins that context, and
    backward returns its gradient to ``src``."""
    agent = _require_agent()
    if src == agent.rank:
        raise ValueError("receive from self would deadlock")
    inbox = _inbox_of(src)
    try:
        item = inbox.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"recv(src={src}): nothing arrived within {timeout:g} s") from None
    if isinstance(item, ProcessFailure):  # src died: Note [Contexts of a dead worker]
        inbox.put(item)  # (for the next recv from it too)
        raise item
    envelope, payloads = item
    return message.decode(envelope["body"], payloads,
                          lambda tensors, ids: attach_recv(tensors, ids, src))


def _inbox_of(src):
    with _inbox_lock:
        return _inbox.setdefault(src, queue.Queue())


def _serve_p2p(src, envelope, payloads):
    _inbox_of(src).put((envelope, payloads))


rpc.register_codec(_AutogradCodec())
