"""The RPC agent: MPI point-to-point transport, a progress thread, and a pool running requests.

Note [RPC wire format]
    A message is an envelope (pickled dict: kind, id, reply-to id, payload shapes and dtypes,
    the pickled argument skeleton) sent with tag ENVELOPE_TAG, preceded by one MPI message per
    array payload with a tag derived from the message id. Payloads are posted first, so when
    the envelope arrives its payloads are already on their way; messages with the same tag
    from one sender do not overtake each other, so payloads are received in order. Every
    Isend keeps its buffer in ``_pending_sends`` until MPI reports it complete.
    Payloads of at most INLINE_BYTES in all travel inside the envelope instead: one MPI message
    per RPC instead of one per array.

Note [Progress thread and the GIL]
    The progress thread sleeps between every two polls, also while messages are flowing. A
    thread that polls in a Python loop keeps the GIL except for the instant of each MPI call,
    and a thread waiting for the GIL (the pool thread that must run a request, the caller woken
    by its reply) only wins it when its 5 ms switch interval expires: hops cost milliseconds.
    Sleeping releases the GIL for real. Sleeps start at 10 us (the thread's timer slack is set
    to 1 ns, or Linux would round them up to 60 us), and double up to 0.5 ms once the agent has
    been quiet for 2 ms. On 2 busy cores a polling loop makes the 1x8 round trip over twice as
    slow (``mpiexec -n 2 python benchmarks/dist_autograd.py``).

Note [A poll is several probes]
    One ``Iprobe`` does not always see a message that has arrived: each call moves the message
    one step further through MPICH's progress engine (ch4:ucx, shared memory), so a receiver
    that sleeps 0.5 ms between single Iprobes sees a 32-byte message ~1.5 ms after it was sent,
    ~0.35 ms with three or more Iprobes a poll. So a poll is up to ``_PROBES_PER_POLL`` Iprobes
    in a row (0.13 us each when nothing is there); the 256x1024 round trip of
    ``mpiexec -n 2 python benchmarks/dist_autograd.py`` shows the hops' latency.

Note [Broadcast payloads]
    An array with broadcast axes (stride 0: ``np.broadcast_to``, ``expand``, the gradient
    of a ``sum`` or ``mean``) travels as its distinct elements and the shape to broadcast them
    to, and arrives as the same read-only broadcast view; as PyTorch's RPC sends an expanded
    tensor's storage, not its elements. The gradient of ``y.sum()`` for a 256x1024 ``y`` is then
    4 bytes inside the envelope, not 1 MB copied to make it contiguous and again on receipt.

Note [Replies on the callback pool]
    A reply completes its future on a small pool of its own (never on the request pool), unless
    its request said the reply is cheap to complete (``request(..., inline_reply=...)``): its
    callbacks decode the result and may do real work (a user's ``then``), so one slow callback
    must not stall every RPC of the rank; and requests that block waiting for a nested RPC's
    reply can fill the request pool without starving the replies they wait for. The pool costs
    one thread handoff per reply, so a reply whose only callbacks are known to be short (an
    ``rpc_sync`` nobody chained a callback to, a distributed-autograd "done") is completed on
    the progress thread itself, and its waiter wakes straight from there.

Note [Waiting threads receive]
    A thread that waits for a reply (``RpcFuture.wait``, the thread that runs a backward pass)
    receives and dispatches the rank's messages itself meanwhile (``progress_until``), exactly
    as the progress thread does, instead of sleeping on an event that the progress thread
    sets: the reply then wakes one thread, not two (the progress thread from its poll sleep,
    then the waiter from the event), and on a loaded machine each wake-up waits for a core. A
    lock keeps Iprobe and its Recv together on one thread. While a waiter polls (it did in the
    last 2 ms) the progress thread leaves receiving to it and sleeps until the 2 ms would be
    up (or its next deadline: a carried message, a request's timeout), and takes over when it
    wakes to find the waiter gone: so a waiter stuck in a long callback cannot stall the rank
    for more than ~2 ms, nor can a message that comes while nobody waits. It does not poll
    meanwhile: each poll would take the GIL from the waiter at its next MPI call, for the
    ~15 us of a loop, on both ranks of every round trip. What
    a waiter runs this way is what the progress thread runs: inline handlers and replies that
    are short and never block (Note [Replies on the callback pool]), so it never waits for
    itself. Decoding must therefore not depend on the receiving thread's state: a reply's
    tensors join their sender's context, not the receiving thread's current one.

Note [How long a waiter sleeps]
    For its first 0.5 ms, and 0.5 ms after each message it handled, a waiting thread does not
    sleep between polls but yields its core (``sched_yield``, which also lets go of the GIL):
    the next message of an exchange (a reply, the next request of a round trip) usually comes
    within that, and a 10 us sleep on a virtual machine takes 15-30 us to come back from, once
    per message: yielding takes about a tenth of a millisecond off the 1x8 round trip's median
    (4 messages; ``mpiexec -n 2 python benchmarks/dist_autograd.py``). Any other runnable
    thread on the core goes first, and Python threads of the rank that want the GIL wait at
    most the window. Where a node has more ranks than cores (tests at 3 and 4 ranks on 2
    cores) waiters do not yield but sleep: there yielding slows the job down.
    After the window a waiter polls every 10 us until 2 ms have passed, then backs off,
    doubling, to 0.1 ms until it has waited 0.1 s, and only then to the progress thread's
    0.5 ms. A reply that takes a few milliseconds (a 256x1024 stage of
    benchmarks/dist_autograd.py) is then noticed ~0.05 ms late on average (~0.3 ms with 0.5 ms
    sleeps), for a poll (~5 us of a core) every 0.1 ms meanwhile. A thread that waits for long
    (a slow remote function, a rank parked in ``rpc.shutdown()``) costs as little as the
    progress thread. These numbers are ``waiting.rpc_waiter()`` (Note [One waiting policy] in
    hpcgrad/comm/waiting.py: the one Backoff every polling wait uses).

Note [Serving threads]
    A thread with nothing else to do while it waits (``rpc.shutdown()`` waiting for every
    rank: ``join``) serves: it receives the rank's messages (Note [Waiting threads receive])
    and runs what they ask for itself (a request's user function, a reply's callbacks, a
    peer's part of a backward pass), instead of handing it to a pool thread. A rank that only
    serves (rank 1 of benchmarks/dist_autograd.py; every callee of PyTorch's RPC examples, its
    main thread parked in ``rpc.shutdown()``) then wakes no other thread per message: on a
    2-core machine each such hop costs ~100 us of a 1x8 round trip, and the woken pool
    thread keeps a core that the caller's poller needs. The work runs after the receive lock
    is released, and as for any waiter stuck in a callback, when it lasts longer than the
    grace (2 ms) the progress thread takes over receiving (handing what comes meanwhile to
    the pools): so work that blocks or runs long, even one waiting for a nested
    RPC, stalls the rank's other messages by at most ~2 ms, and short work (a reply a few
    microseconds later) is not raced by a second receiver. Any other thread (a caller waiting
    for its reply, the progress thread) hands such work on. A user function (or a part of a
    backward pass) then runs on the main thread, where Ctrl-C lands: the caller gets the
    KeyboardInterrupt as the call's error (the pass's origin, as the pass's) and
    ``rpc.shutdown()`` raises it, as when Ctrl-C meets its wait.

Note [Quiet shutdown]
    ``rpc.shutdown()`` returns, as PyTorch's graceful one, once every rank has called it and
    no work is left anywhere: no message in flight, none being served, no request waiting for
    its reply. Each rank counts the envelopes it sent and received and its work in progress
    (handed to a pool or a serving thread and not done, replies that an async function still
    owes (Note [Async execution] in functions.py), requests waiting for a reply, calls queued
    for the progress thread, carried messages); shutdown gathers those (a nonblocking
    all-gather on the agent's communicator, serving meanwhile) in rounds until two rounds in a
    row find no work on any rank and each rank's counts unchanged with as many received as
    sent. Every rank's first-round numbers are taken before any rank's second, so nothing was
    sent, received or running in between: the job was quiet. A barrier is not enough: a
    request or reply still in flight when every rank has reached shutdown would never be
    received, its sender's stop() would wait for the send to complete, and a message of one
    init_rpc/shutdown cycle could be left on a freed communicator. No limit by default
    (PyTorch's DEFAULT_SHUTDOWN_TIMEOUT, 0): a worker parked in shutdown() serves while the
    master trains, for as long as that takes.

Note [RPC to a dead rank]
    Under MPICH, or Open MPI without ``--with-ft ulfm``, a rank that dies ends the job, and the
    agent handles no failure: fail-fast. Under ULFM (``ulfm.enabled()``: ``mpirun --with-ft
    ulfm``; Note [Process failures under ULFM] in comm/ulfm.py) the job goes on, and the agent
    learns of a death from an MPI call that fails with MPI_ERR_PROC_FAILED (its communicator
    returns errors). It needs no call of its own for that: while any failure on its
    communicator is unacknowledged, the ``Iprobe(ANY_SOURCE)`` that every poll makes (the
    progress thread's, every 10 us to 0.5 ms; a waiting thread's) fails, on every rank, whether
    or not it ever talked to the dead one; so does a send to it (``Isend``, or its request's
    test). Measured here (3 ranks on 2 cores, tests/elastic/test_rpc_failure.py with -s):
    7-20 ms from ``os._exit(9)`` or SIGKILL to the failed future on the caller (once 60 ms, on
    a loaded machine), against the 60 s RPC timeout. Messages pay a try block around each
    poll and a check of the destination on each send (~80 ns); ``Comm.Get_failed`` on each
    poll would add an MPI call for what the failing Iprobe already says.
    On such an error (``_peer_failure``) the agent acknowledges the failures
    (MPI_Comm_ack_failed: receives from any source work again), asks which ranks failed
    (MPI_Comm_get_failed), and for each new one fails every request pending to it with a
    ProcessFailure (comm/ulfm.py's, a RuntimeError) naming the worker and rank, "RPC to worker
    'worker2' (rank 2) failed: that process died (...)"; later requests to it fail at once with
    the same error (rpc_async and remote return a failed future, so an RRef it owns fails at
    ``to_here()``); replies and carried messages to it are dropped (nobody waits for them);
    then the failure listeners run (distributed autograd's: Note [Contexts of a dead worker]
    in dist_autograd/__init__.py). Graceful shutdown (Note [Quiet shutdown]) cannot
    all-gather over a communicator with a dead rank, so once one died the survivors first
    meet in MPI_Comm_shrink (on a helper thread while the caller serves; bounded by
    shutdown's timeout) and run the quiet rounds on the shrunk communicator, counting only
    messages between survivors; a death noticed during a round makes them shrink again. The
    agent's communicator is then left unfreed, and the survivors end at exit together, without
    MPI_Finalize (failures.py). Not done: the world is not rebuilt (nothing replaces the dead
    rank; elastic.run refuses RPC); the reference counts of RRefs the dead rank held stay up
    (their owners keep those values); a rank that hangs without dying is no failure here (its
    RPCs time out as before).

Note [Carried messages]
    Some messages need not leave at once: a context release (nothing waits for it). ``carry``
    queues such a message for a peer; it rides inside the envelope of the next message to that
    peer (no MPI message of its own), and the receiver handles it, inline and in order, before
    the message that carried it. One that finds no ride within ``within`` seconds is sent on
    its own by the progress thread, and ``join`` (shutdown) sends every one still queued, so
    none waits unboundedly.
"""

import collections
import heapq
import itertools
import pickle
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from mpi4py import MPI

from hpcgrad.comm import ulfm, waiting
from hpcgrad.comm.buffers import MessageBuffer
from hpcgrad.comm.progress import ProgressLoop
from hpcgrad.comm.rendezvous import rendezvous
from hpcgrad.base.futures import Future
from hpcgrad.rpc.failures import DeadPeers, take_waiting_for

ENVELOPE_TAG = 1
INLINE_BYTES = 8192         # payloads this small ride in the envelope: Note [RPC wire format]
_PAYLOAD_TAG_BASE = 2
# How long threads sleep between polls: waiting.rpc_waiter() and rpc_progress(), Note [One
# waiting policy] in hpcgrad/comm/waiting.py.
_PROBE_SECONDS = 0.25  # quiesce's least interval between two MPI_Comm_get_failed (_failure_known)
_POLLER_GRACE_SECONDS = 2e-3  # a waiting thread that polled this recently receives alone
_PROBES_PER_POLL = 4        # Iprobes in a row that make one poll: Note [A poll is several probes]
MAX_NAME_LEN = 128          # PyTorch's WorkerInfo limit on a worker name


def _valid_name(name):
    """PyTorch's WorkerInfo rule: 1 to 127 characters out of [A-Za-z0-9-_:]."""
    return (isinstance(name, str) and 0 < len(name) < MAX_NAME_LEN
            and all(c.isascii() and (c.isalnum() or c in "-_:") for c in name))


_serving = threading.local()  # .work: a serving thread's list of deferred work, while it receives


def run_here_later(fn, *args):
    """On a serving thread that is receiving a message: queue ``fn(*args)`` to run on it once it
    has stopped receiving, and return True; elsewhere False (the caller hands it to a pool).
    Note [Serving threads]."""
    work = getattr(_serving, "work", None)
    if work is None:
        return False
    work.append((fn, args))
    return True


def unbroadcast(array):
    """(``array`` without its broadcast axes, the shape it had), or (``array``, None) when no
    axis of it is broadcast (stride 0): Note [Broadcast payloads]."""
    strides = array.strides
    if 0 not in strides or array.size <= 1:
        return array, None
    small = array[tuple(slice(0, 1) if stride == 0 else slice(None)
                        for stride in strides)]
    return small, tuple(array.shape)


class RpcError(RuntimeError):
    """An RPC failed on the remote side or could not be delivered."""


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC did not complete within its timeout."""


class AgentShutDown(RpcError):
    """A message sent after shutdown found every rank quiet (Note [Quiet shutdown])."""


class RpcFuture(Future):
    """The eventual result of an RPC: hpcgrad's one Future (Note [One Future] in
    hpcgrad/base/futures.py) whose wait raises RpcTimeoutError and which carries its RPC's timeout."""

    timeout_error = RpcTimeoutError

    def __init__(self, describe="", timeout=None, wait_fn=None, agent=None):
        super().__init__(wait_fn=wait_fn, describe=describe)
        self.timeout = timeout
        self._agent = agent  # whose messages the waiting thread receives itself

    def wait(self, timeout=None):
        """As Future.wait; meanwhile the waiting thread receives the agent's messages itself
        (Note [Waiting threads receive])."""
        agent = self._agent
        if (agent is not None and not self.done() and not agent.progress_until(self.done, timeout)
                and agent.running):
            raise self.timeout_error(f"{self.describe or 'Future'} timed out after "
                                     f"{timeout:g} s")
        return super().wait(timeout)  # (a stopped agent's: as Future.wait)

    result = wait

    def has_callbacks(self):
        """Whether callbacks wait for its completion (a reply with none is completed inline:
        Note [Replies on the callback pool])."""
        return bool(self._callbacks)

    def _chained(self):
        return RpcFuture(self.describe, self.timeout)


class MPIRpcAgent:
    """Sends and serves RPCs for one rank over a private duplicate of COMM_WORLD."""

    def __init__(self, name, comm, num_worker_threads=8, num_callback_threads=4, init_timeout=0,
                 allowed=None):
        """Collective over ``comm``; past ``init_timeout`` s (0: none) without every rank, the
        job ends naming the missing ranks (Note [Bounded start-up] in comm/rendezvous.py).
        ``allowed``: None (every peer trusted) or a message.Allowed policy that every message
        received is unpickled with (Note [What a worker unpickles] in message.py)."""
        self.allowed = allowed
        self.loads = pickle.loads if allowed is None else allowed.loads
        self._envelope_loads = pickle.loads if allowed is None else allowed.envelope_loads
        rendezvous(comm, init_timeout, "init_rpc",
                   "every rank must call init_rpc(); check the missing ranks' output (an "
                   "error, an exit or a long step before it), or give it more time: "
                   "rpc_backend_options=TensorPipeRpcBackendOptions(rpc_timeout=...)")
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.name = name
        self.names = self.comm.allgather(name)
        # Note [How long a waiter sleeps]: yield only where every rank of the node has a core
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._yield_seconds = waiting.rpc_yield_seconds(node.Get_size())
        node.Free()
        # Checked on the gathered names, so every rank raises together (none is left waiting)
        invalid = [n for n in self.names if not _valid_name(n)]
        if invalid:
            self.comm.Free()
            raise RuntimeError(f"Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty "
                               f"and shorter than {MAX_NAME_LEN} chars, but got {invalid[0]!r} "
                               f"(names by rank: {self.names}); as PyTorch, init_rpc takes "
                               f"letters, digits, '-', '_' and ':' only")
        if len(set(self.names)) != self.size:
            repeated = sorted({n for n in self.names if self.names.count(n) > 1})
            self.comm.Free()
            raise RuntimeError(f"init_rpc: worker name {repeated[0]!r} is not unique (names by "
                               f"rank: {self.names}); give every rank its own name")
        # Note [RPC to a dead rank]: under ULFM a peer's death is an error to handle, not an
        # end of the job (under MPICH, or without --with-ft ulfm, none is handled: fail-fast)
        self._failure_classes = ulfm.failure_classes() if ulfm.enabled() else frozenset()
        self._probed_at = 0.0  # when _failure_known last asked MPI
        if self._failure_classes:
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        group = self.comm.Get_group()
        self.dead = DeadPeers(self.names, ulfm.world_ranks(group), self.rank)
        group.Free()
        self._failure_lock = threading.Lock()
        self._failure_listeners = []  # fn(ranks), called once per newly dead rank list
        self._abandoned = []          # sends to the dead: buffers kept, never freed under MPI
        self._ids = itertools.count(1)
        self._tag_window = max(min(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767, 1 << 30)
                               - _PAYLOAD_TAG_BASE, 1)
        self._send_lock = threading.Lock()
        self._pending_sends = []      # (requests, buffers) alive until MPI completes them
        self._waiting = {}            # message id -> RpcFuture of its reply
        self._deadlines = []          # heap of (deadline, message id) of requests with a timeout
        self._waiting_lock = threading.Lock()
        self._handlers = {}           # kind -> handler(src, envelope, obj) run on the pool
        self._pool = ThreadPoolExecutor(num_worker_threads,
                                        thread_name_prefix=f"hpcgrad-rpc-{self.rank}")
        # Note [Replies on the callback pool]
        self._callback_pool = ThreadPoolExecutor(num_callback_threads,
                                                 thread_name_prefix=f"hpcgrad-rpc-reply-{self.rank}")
        self.messages_sent = 0        # MPI messages posted (envelopes and payloads): a figure
        # envelopes sent to and received from each rank: Note [Quiet shutdown]
        self._sent_to, self._received_from = [0] * self.size, [0] * self.size
        # Set once quiesce found every rank quiet: no envelope may leave after that (an RRef
        # handle freed later still sends its "forget"). One that left late was never received
        # on this communicator; the next init_rpc's got the freed one's context id from MPICH
        # and received it there, and that shutdown counted one envelope more received than
        # sent on every round, for ever (tests/rpc/test_rpc_issue26.py's 50 cycles, under load:
        # 2 hangs in 12 runs before).
        self._quiet = False
        self._dispatched = 0          # work handed to a pool or a serving thread, not yet done
        self._dispatched_lock = threading.Lock()
        self.sent_by_kind = collections.Counter()  # envelopes per kind; "+kind": carried ones
        self._carried = {}            # dst -> [(kind, fields)]: Note [Carried messages]
        self._carried_lock = threading.Lock()
        self._next_carry_deadline = None
        self._soon = collections.deque()  # functions for the progress thread (call_soon)
        self._running = False
        self._receive_lock = threading.Lock()  # one receiver at a time: Iprobe, then its Recv
        self._polled_at = 0.0  # when a waiting thread last polled (Note [Waiting threads receive])
        self._status = MPI.Status()  # the progress thread's
        self._loop = ProgressLoop(f"hpcgrad-rpc-progress-{self.rank}", self._progress_step,
                                  waiting.rpc_progress())

    @property
    def running(self):
        return self._running

    def start(self):
        """Start serving: call after every handler is registered (a message that arrives
        earlier waits inside MPI, instead of meeting a rank that cannot handle it yet)."""
        self._running = True
        self._loop.start()

    # --- sending --------------------------------------------------------------------------------
    def _payload_tag(self, message_id):
        return _PAYLOAD_TAG_BASE + message_id % self._tag_window

    def send(self, dst, kind, body=b"", payloads=(), **fields):
        """Post a message (nonblocking); returns its id. The agent owns the buffers until sent."""
        message_id = next(self._ids)
        self._send_with_id(message_id, dst, kind, body, payloads, None, fields)
        return message_id

    def request(self, dst, kind, body=b"", payloads=(), describe="", timeout=None,
                inline_reply=None, **fields):
        """Send and return an RpcFuture completed by the reply (set before the send: no race).

        Past ``timeout`` seconds (None or 0: never) the future fails with RpcTimeoutError and
        the request is forgotten: a late reply is dropped. ``inline_reply``: True when the
        future's callbacks are short and never block, or a function saying so when the reply
        comes; the reply then completes the future on the progress thread (Note [Replies on
        the callback pool]).
        """
        future = RpcFuture(describe or f"{kind} to {self.names[dst]} (rank {dst})", timeout,
                           agent=self)
        future.inline_reply = inline_reply
        future.dst = dst  # a dead destination fails it: Note [RPC to a dead rank]
        if dst in self.dead:
            future.set_exception(self.dead.error(dst, f"{future.describe} was not sent"))
            return future
        message_id = future.message_id = next(self._ids)
        future.deadline = time.monotonic() + timeout if timeout else None
        with self._waiting_lock:
            self._waiting[message_id] = future
            if timeout:
                heapq.heappush(self._deadlines, (future.deadline, message_id))
        try:
            self._send_with_id(message_id, dst, kind, body, payloads, None, fields)
        except ulfm.ProcessFailure as error:  # it died before this rank knew: as above
            with self._waiting_lock:
                self._waiting.pop(message_id, None)
            future.try_set_exception(error)
        except BaseException:
            with self._waiting_lock:
                self._waiting.pop(message_id, None)
            raise
        return future

    def _send_with_id(self, message_id, dst, kind, body, payloads, reply_to, fields):
        if not 0 <= dst < self.size:
            raise ValueError(f"no worker with rank {dst} (world size {self.size})")
        if dst in self.dead:  # Note [RPC to a dead rank]
            raise self.dead.error(dst, f"a {kind!r} message was not sent")
        specs = []
        if payloads:  # Note [Broadcast payloads]: a broadcast array sends its distinct elements
            sent = []
            for a in payloads:
                small, shape = unbroadcast(a)
                if shape is not None and not small.flags.c_contiguous:
                    small = np.ascontiguousarray(small)
                sent.append(small)
                specs.append((small.shape, small.dtype.str, shape))
            payloads = sent
        envelope = dict(fields, kind=kind, id=message_id, reply_to=reply_to, body=body,
                        specs=specs)
        if self._carried:
            carried = self._take_carried(dst)
            if carried:
                envelope["carried"] = carried
        if payloads and sum(a.nbytes for a in payloads) <= INLINE_BYTES:
            envelope["inline"] = [a.tobytes() for a in payloads]
            payloads = ()
        data = np.frombuffer(pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        buffers = [MessageBuffer(a) for a in payloads]
        tag = self._payload_tag(message_id)
        requests = []
        try:
            with self._send_lock:
                if self._quiet:
                    raise AgentShutDown(f"rank {self.rank}: a {kind!r} message to rank {dst} "
                                        f"after rpc.shutdown() found every worker done")
                for b in buffers:
                    requests.append(self.comm.Isend(b.spec, dest=dst, tag=tag))
                requests.append(self.comm.Isend([data, MPI.BYTE], dest=dst, tag=ENVELOPE_TAG))
                self._pending_sends.append((requests, (buffers, data)))
                self.messages_sent += len(requests)
                self._sent_to[dst] += 1
                self.sent_by_kind[kind] += 1
                for carried_kind, _ in envelope.get("carried", ()):
                    self.sent_by_kind["+" + carried_kind] += 1
        except MPI.Exception as error:  # it died before this rank knew: Note [RPC to a dead rank]
            if error.Get_error_class() not in self._failure_classes:
                raise
            self._abandoned.append((requests, (buffers, data)))  # MPI may still hold them
            self._peer_failure(error)
            if dst in self.dead:
                raise self.dead.error(dst, f"a {kind!r} message was not sent") from None
            raise

    def reply(self, dst, to_id, kind, body=b"", payloads=(), **fields):
        """Answer request ``to_id`` of ``dst``; nothing when ``dst`` died (nobody waits)."""
        if dst in self.dead:
            return
        try:
            self._send_with_id(next(self._ids), dst, kind, body, payloads, to_id, fields)
        except ulfm.ProcessFailure:
            if dst not in self.dead:
                raise

    def carry(self, dst, kind, within=5e-3, **fields):
        """Send a message of ``kind`` (no body, no payloads, no reply) to ``dst`` on the next
        message that goes there anyway, or on its own after ``within`` seconds: Note [Carried
        messages]. Its handler must be registered ``inline`` on the receiver."""
        if not 0 <= dst < self.size:
            raise ValueError(f"no worker with rank {dst} (world size {self.size})")
        if dst in self.dead or self._quiet:  # what it says concerns the dead only, or comes
            return                           # after every worker is done (see _quiet)
        deadline = time.monotonic() + within
        with self._carried_lock:
            self._carried.setdefault(dst, []).append((kind, fields))
            if self._next_carry_deadline is None or deadline < self._next_carry_deadline:
                self._next_carry_deadline = deadline

    def _take_carried(self, dst):
        with self._carried_lock:
            return self._carried.pop(dst, None)

    def flush_carried(self):
        """Send every carried message still waiting for a ride, each peer's in one message."""
        with self._carried_lock:
            destinations = list(self._carried)
            self._next_carry_deadline = None
        for dst in destinations:  # an empty envelope picks them up
            with self._carried_lock:
                if dst not in self._carried:
                    continue
            try:
                self.send(dst, "carrier")
            except AgentShutDown:  # carried just before every worker was found done: moot
                self._take_carried(dst)
            except ulfm.ProcessFailure:
                if dst not in self.dead:
                    raise

    def call_soon(self, fn):
        """Run ``fn()`` on the progress thread soon. Safe from anywhere, also from ``__del__``
        or a signal handler (deque.append takes no lock that its caller might hold)."""
        self._soon.append(fn)

    def _run_soon(self):
        # A function leaves the deque only once it has run: quiesce counts the deque as work
        # outstanding, and an RRef's "forget" popped but not yet sent looked like no work and
        # no message (Note [Quiet shutdown]; the late envelope: ``_quiet``)
        while self._soon:
            try:
                self._soon[0]()
            except BaseException:  # noqa: BLE001  (a bug in fn: report it, keep serving)
                traceback.print_exc()
            finally:
                self._soon.popleft()

    def fail_pending(self, error):
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.try_set_exception(error)  # a reply may have won the race

    # --- dead peers: Note [RPC to a dead rank] ----------------------------------------------------
    def add_failure_listener(self, fn):
        """Call ``fn(ranks)`` (a list of ranks that died) on the thread that notices a death,
        after the RPCs pending to them have failed; it must be short and never block."""
        self._failure_listeners.append(fn)

    def _ranks_of(self, group):
        """The ranks of this agent's communicator of the processes in ``group``."""
        mine = self.comm.Get_group()
        try:
            return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), mine))
        finally:
            mine.Free()

    def _peer_failure(self, error):
        """An MPI call met MPI_ERR_PROC_FAILED (``error``): acknowledge the failures known here
        (so receives from any source work again), fail every RPC pending to a rank that died,
        drop what was carried to it and tell the listeners. Returns the newly dead ranks."""
        with self._failure_lock:
            try:
                self.comm.Ack_failed()
                group = self.comm.Get_failed()
            except MPI.Exception:  # nothing more can be learned here; the caller goes on
                return []
            try:
                ranks = self._ranks_of(group)
            finally:
                group.Free()
        return self._mark_dead(ranks, str(error))

    def _mark_dead(self, ranks, why):
        """``ranks`` died (``why``: how it showed): the work of ``_peer_failure``."""
        new = self.dead.add(ranks, why)
        if not new:
            return new
        ulfm.leave_without_finalize_at_exit()  # Note [Leaving without MPI_Finalize after a failure]
        with self._waiting_lock:
            failed = take_waiting_for(self._waiting, new)
        for future in failed:  # a reply may have won the race
            future.try_set_exception(self.dead.error(future.dst,
                                                     f"{future.describe} did not complete"))
        with self._carried_lock:
            for rank in new:
                self._carried.pop(rank, None)
        for listener in list(self._failure_listeners):
            try:
                listener(new)
            except BaseException:  # noqa: BLE001  (a bug in a listener: report it, go on)
                traceback.print_exc()
        return new

    def cancel(self, future, error):
        """Forget the request of ``future`` (a reply is dropped) and fail it with ``error``."""
        with self._waiting_lock:
            self._waiting.pop(getattr(future, "message_id", None), None)
        future.try_set_exception(error)

    def work_started(self):
        """Count one piece of work that runs outside the pools (a reply an async function owes:
        Note [Async execution] in functions.py) as outstanding until ``work_done``, so a
        graceful shutdown waits for it (Note [Quiet shutdown])."""
        with self._dispatched_lock:
            self._dispatched += 1

    def work_done(self):
        with self._dispatched_lock:
            self._dispatched -= 1

    def pending_count(self):
        """Requests still waiting for their reply."""
        with self._waiting_lock:
            return len(self._waiting)

    def _expire_requests(self):
        now = time.monotonic()
        expired = []
        with self._waiting_lock:
            deadlines = self._deadlines
            while deadlines and deadlines[0][0] <= now:
                future = self._waiting.pop(heapq.heappop(deadlines)[1], None)
                if future is not None:
                    expired.append(future)
            if len(deadlines) > 2 * len(self._waiting) + 1024:  # drop answered requests
                self._deadlines = [d for d in deadlines if d[1] in self._waiting]
                heapq.heapify(self._deadlines)
        for future in expired:
            future.try_set_exception(self._timed_out(future))

    @staticmethod
    def _timed_out(future):
        # PyTorch's phrase first (what users search for), then which call and its limit
        return RpcTimeoutError(f"RPC ran for more than set timeout ({future.timeout * 1e3:g} ms) "
                               f"and will now be marked with an error: {future.describe} timed "
                               f"out after {future.timeout:g} s")

    # --- receiving ------------------------------------------------------------------------------
    def register_handler(self, kind, handler, inline=False):
        """``handler(src, envelope, payloads)`` for each message of ``kind``: on the pool, or
        ``inline`` on the progress thread (quick handlers that must keep arrival order).
        Register before ``start()``."""
        self._handlers[kind] = (handler, inline)

    def _progress_step(self):
        """One turn of the progress thread (a ProgressLoop): poll for a message, complete
        sends, expire requests, flush carried messages; Note [Progress thread and the GIL]."""
        if self._soon:
            self._run_soon()
        # Reaping sent buffers is bookkeeping, not activity: MPI moves the data inside any
        # call of any thread, so it does not keep this thread polling at the short interval
        self._complete_sends()
        now = time.monotonic()
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_requests()
        if self._next_carry_deadline is not None and self._next_carry_deadline <= now:
            self.flush_carried()
        if now - self._polled_at <= _POLLER_GRACE_SECONDS:
            # a waiting thread receives: sleep until it might need relief, or the next
            # deadline (Note [Waiting threads receive])
            wake = self._polled_at + _POLLER_GRACE_SECONDS
            if self._next_carry_deadline is not None:
                wake = min(wake, self._next_carry_deadline)
            if self._deadlines:
                wake = min(wake, self._deadlines[0][0])
            return min(max(wake - now, waiting.FIRST_SLEEP), _POLLER_GRACE_SECONDS)
        # (even after a message it sleeps: Note [Progress thread and the GIL])
        return self._poll_once(self._status)

    def _poll_once(self, status, work=None):
        """Receive and dispatch one message if one is there (and no other thread is at it).
        ``work``: a list, on a serving thread, that gets the work the message asks for instead
        of a pool (Note [Serving threads])."""
        if not self._receive_lock.acquire(blocking=False):
            return False
        try:
            for _ in range(_PROBES_PER_POLL):  # Note [A poll is several probes]
                if self.comm.Iprobe(MPI.ANY_SOURCE, ENVELOPE_TAG, status):
                    outer, _serving.work = getattr(_serving, "work", None), work
                    try:
                        self._receive(status.Get_source(), status.Get_count(MPI.BYTE))
                    finally:
                        _serving.work = outer
                    return True
            return False
        except MPI.Exception as error:  # Note [RPC to a dead rank]: how a death shows here
            if error.Get_error_class() not in self._failure_classes:
                raise
            failure = error
        finally:
            self._receive_lock.release()
        self._peer_failure(failure)  # (outside the receive lock: it runs listeners)
        return True

    def progress_until(self, done, timeout=None, serve=False):
        """On a thread waiting for ``done()``: receive and dispatch this rank's messages itself
        until then, or for ``timeout`` s (None: no limit; 0: one look); returns ``done()``.
        Note [Waiting threads receive]. ``serve``: also run the work they ask for, on this
        thread (Note [Serving threads])."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        status = MPI.Status()
        work = [] if serve else None
        waiting.allow_short_sleeps()
        try:
            backoff = waiting.rpc_waiter(self._yield_seconds)
            while not done():
                if not self._running:  # stopping: nothing will arrive any more
                    return done()
                self._polled_at = time.monotonic()
                if self._poll_once(status, work):
                    if work:  # past the grace the progress thread receives meanwhile
                        self._run_work(work)
                    backoff.restart(time.monotonic())
                    continue
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return done()
                backoff.pause(now, deadline)  # Note [How long a waiter sleeps]
            return True
        finally:
            self._polled_at = 0.0  # the progress thread receives again when it next wakes

    @staticmethod
    def _run_work(work):
        while work:
            fn, args = work.pop(0)
            try:
                fn(*args)
            except KeyboardInterrupt:  # Ctrl-C on a serving main thread: stop serving
                raise
            except BaseException:  # noqa: BLE001  (as a pool thread would: print, keep serving)
                traceback.print_exc()

    def _complete_sends(self):
        failure = None
        with self._send_lock:
            if not self._pending_sends:
                return False
            still = []
            for entry in self._pending_sends:
                try:
                    if not MPI.Request.Testall(entry[0]):
                        still.append(entry)
                except MPI.Exception as error:  # a send to a rank that died
                    if error.Get_error_class() not in self._failure_classes:
                        raise
                    failure = error
                    self._abandoned.append(entry)
            done = len(still) != len(self._pending_sends)
            self._pending_sends = still
        if failure is not None:
            self._peer_failure(failure)
        return done

    def _receive(self, src, nbytes):
        data = np.empty(nbytes, np.uint8)
        self.comm.Recv([data, MPI.BYTE], source=src, tag=ENVELOPE_TAG)
        self._received_from[src] += 1  # (under the receive lock)
        try:
            envelope = self._envelope_loads(data.tobytes())
        except pickle.UnpicklingError as exc:  # a refused global: no id to answer to
            print(f"rank {self.rank}: dropped a message from rank {src}: {exc}", flush=True)
            return
        carried = envelope.pop("carried", None)
        if carried:  # Note [Carried messages]: handled before the message that carried them
            for kind, fields in carried:
                handler, _ = self._handlers.get(kind, (None, False))
                if handler is None:  # a bug: carry() names inline handlers only
                    print(f"rank {self.rank}: no handler for carried {kind!r} messages")
                    continue
                self._run_handler(handler, src, dict(fields, kind=kind), [])
        if envelope["kind"] == "carrier":
            return
        inline = envelope.pop("inline", None)
        if inline is not None:  # writable arrays of their own (bytearray), like received ones
            payloads = [np.frombuffer(bytearray(raw), np.dtype(dtype)).reshape(shape)
                        for raw, (shape, dtype, _) in zip(inline, envelope["specs"])]
        else:
            tag = self._payload_tag(envelope["id"])
            payloads = []
            for shape, dtype, _ in envelope["specs"]:
                array = np.empty(shape, np.dtype(dtype))
                self.comm.Recv(MessageBuffer(array, writable=True).spec, source=src, tag=tag)
                payloads.append(array)
        for i, (_, _, shape) in enumerate(envelope["specs"]):
            if shape is not None:  # Note [Broadcast payloads]
                payloads[i] = np.broadcast_to(payloads[i], shape)
        reply_to = envelope.get("reply_to")
        if reply_to is not None:
            with self._waiting_lock:
                future = self._waiting.pop(reply_to, None)
            if future is None:
                return
            if future.deadline is not None and time.monotonic() >= future.deadline:
                # Past its deadline the request has timed out, whether or not the progress
                # thread has looked at the heap yet: a late reply is dropped, never used.
                future.try_set_exception(self._timed_out(future))
                return
            inline_reply = future.inline_reply  # Note [Replies on the callback pool]
            if inline_reply is True or (inline_reply is not None and inline_reply()):
                self._resolve(future, src, envelope, payloads)
            else:
                self._dispatch(self._callback_pool, self._resolve, future, src, envelope, payloads)
            return
        handler, inline = self._handlers.get(envelope["kind"], (None, False))
        if handler is None:
            self.reply(src, envelope["id"], "error", error_type="RpcError", worker=self.name,
                       rank=self.rank, traceback="",
                       error=f"rank {self.rank} has no handler for {envelope['kind']!r} messages")
            return
        if inline:
            self._run_handler(handler, src, envelope, payloads)
        else:
            self._dispatch(self._pool, self._run_handler, handler, src, envelope, payloads)

    def _dispatch(self, pool, fn, *args):
        """Run ``fn(*args)`` on this serving thread once it stops receiving, else on ``pool``;
        counted until done (Note [Quiet shutdown])."""
        with self._dispatched_lock:
            self._dispatched += 1

        def counted():
            try:
                fn(*args)
            finally:
                with self._dispatched_lock:
                    self._dispatched -= 1

        if not run_here_later(counted):
            pool.submit(counted)

    def _resolve(self, future, src, envelope, payloads):
        future.try_set_result((envelope, payloads))  # may have been cancelled meanwhile

    def _run_handler(self, handler, src, envelope, payloads):
        try:
            handler(src, envelope, payloads)
        except KeyboardInterrupt:  # Ctrl-C on a serving main thread (Note [Serving threads])
            raise
        except BaseException:
            traceback.print_exc()  # handlers reply with errors themselves; this is a bug

    # --- shutdown -------------------------------------------------------------------------------
    def join(self, timeout):
        """Every rank reaches this point (others' requests keep being served meanwhile)."""
        self.flush_carried()  # Note [Carried messages]: nothing is left behind at shutdown
        request = self.comm.Ibarrier()
        # Note [Serving threads]: meanwhile this thread runs the rank's requests itself
        if not self.progress_until(request.Test, timeout or None, serve=True):
            raise RpcTimeoutError(f"rpc.shutdown(): not every worker reached shutdown "
                                  f"within {timeout:g} s")

    def quiesce(self, timeout, close=False):
        """Return once every rank calls this and no work is left anywhere: Note [Quiet
        shutdown]. Serves meanwhile (Note [Serving threads]). Past ``timeout`` s (0 or None:
        no limit) raise RpcTimeoutError saying which ranks still had work, if all came. After
        a worker died, the survivors meet without it (Note [RPC to a dead rank]). ``close``
        (shutdown's): no envelope may leave once it returns (``_quiet``)."""
        deadline = time.monotonic() + timeout if timeout else None
        previous = None
        comm, live = self.comm, list(range(self.size))
        while True:
            if self.dead.any_of(live):
                comm, live = self._survivors(comm, deadline, timeout)
                previous = None
            self.flush_carried()  # Note [Carried messages]: nothing is left behind
            with self._dispatched_lock, self._waiting_lock, self._carried_lock:
                busy = (self._dispatched + len(self._waiting) + len(self._soon)
                        + len(self._carried))
            mine = np.array([sum(self._sent_to[r] for r in live),
                             sum(self._received_from[r] for r in live), busy], np.int64)
            rows = np.empty((len(live), 3), np.int64)
            request = comm.Iallgather(mine, rows)
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not self.progress_until(lambda: self._gathered(request, live), left, serve=True):
                if previous is None:
                    raise RpcTimeoutError(f"rpc.shutdown(): not every worker reached shutdown "
                                          f"within {timeout:g} s")
                working = [live[r] for r in range(len(live)) if previous[r, 2]]
                raise RpcTimeoutError(
                    f"rpc.shutdown(): every worker reached shutdown, but work was still "
                    f"running within {timeout:g} s (RPCs waiting for a reply or being served "
                    f"on rank{'s' if len(working) != 1 else ''} "
                    f"{', '.join(map(str, working)) or '(messages in flight)'})")
            if self.dead.any_of(live):  # a worker died meanwhile
                self._abandoned.append((request, rows, mine))
                continue
            totals = rows.sum(axis=0)
            if (previous is not None and not totals[2] and not previous[:, 2].any()
                    and totals[0] == totals[1] and (rows[:, :2] == previous[:, :2]).all()):
                if close:
                    with self._send_lock:
                        self._quiet = True
                if comm is not self.comm:  # the survivors leave together (comm/ulfm.py)
                    ulfm.leave_without_finalize_at_exit(meet=comm)
                return
            previous = rows.copy()

    def _gathered(self, request, live):
        """Whether quiesce's all-gather is done, or a rank of ``live`` died meanwhile."""
        try:
            return request.Test() or self.dead.any_of(live) or self._failure_known(live)
        except MPI.Exception as error:
            if error.Get_error_class() not in self._failure_classes:
                raise
            self._peer_failure(error)
            if not self.dead.any_of(live):  # failed, yet no survivor known to be dead
                raise
            return True

    def _failure_known(self, live):
        """Whether MPI knows here of a dead rank of ``live`` that no call has reported, asked
        at most every _PROBE_SECONDS (MPI_Comm_get_failed: local, no wait). A nonblocking
        collective whose schedule a failure aborted may neither complete nor fail: CI saw
        Open MPI print "NBC_Progress: an error 75 was found during schedule ... aborting the
        schedule" and both survivors' shutdown wait until the job's time limit."""
        now = time.monotonic()
        if not self._failure_classes or now - self._probed_at < _PROBE_SECONDS:
            return False
        self._probed_at = now
        try:
            group = self.comm.Get_failed()
        except (MPI.Exception, AttributeError, NotImplementedError):
            return False  # nothing more can be learned here
        try:
            found = [rank for rank in self._ranks_of(group) if rank in live]
        finally:
            group.Free()
        if found:
            self._peer_failure("MPI_Comm_get_failed listed it while shutting down")
        return self.dead.any_of(live)

    def _survivors(self, comm, deadline, timeout):
        """(a communicator of ``comm``'s surviving ranks, their ranks here): MPI_Comm_shrink,
        collective over the survivors, run on a helper thread while this one serves (Note
        [Bounded recovery calls] in comm/ulfm.py), up to the deadline."""
        done, outcome = threading.Event(), {}

        def shrink():
            try:
                outcome["comm"] = comm.Shrink()
            except BaseException as error:  # noqa: BLE001  (handed to the waiting thread)
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=shrink, name=f"hpcgrad-rpc-shrink-{self.rank}",
                         daemon=True).start()
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        if not self.progress_until(done.is_set, left, serve=True):
            raise RpcTimeoutError(
                f"rpc.shutdown(): not every surviving worker reached shutdown within "
                f"{timeout:g} s (rank{'s' if len(self.dead) > 1 else ''} "
                f"{', '.join(map(str, self.dead.ranks()))} died)")
        if "error" in outcome:
            raise outcome["error"]
        survivors = outcome["comm"]
        group = survivors.Get_group()
        try:
            live = self._ranks_of(group)
        finally:
            group.Free()
        # a rank left out died, whether or not this one had noticed it yet
        self._mark_dead(set(range(self.size)) - set(live), "left out by MPI_Comm_shrink")
        return survivors, live

    def stop(self):
        self._running = False
        self._loop.stop()
        deadline = time.monotonic() + 10
        while self._pending_sends and time.monotonic() < deadline:
            self._complete_sends()
            time.sleep(1e-4)
        self._pool.shutdown(wait=True)
        self._callback_pool.shutdown(wait=True)
        if not len(self.dead):  # else left unfreed: freeing it could wait on the dead
            self.comm.Free()
