"""The stall inspector: rank 0 says which ranks have not reached a collective that waits too long.

Note [Stall inspector]
    Horovod's stall inspector without its coordinator. Every rank runs a daemon thread that,
    each ``interval`` (1 s, less for short warnings), reads its own latest calls from the flight
    recorder's ring (Note [Flight recorder]: the hot path writes nothing extra) and, when they
    changed, sends them to rank 0 on a private communicator (JSON, ~1 KB, an Isend; Note
    [Diagnostics messages are data]). Rank
    0's thread drains those messages (improbe, never blocking) and, when a collective has waited
    more than HPCGRAD_STALL_WARNING seconds (default 60; 0 turns the inspector off) on some
    rank, prints ONE block to stderr: which call is stalled, which ranks have not reached it and
    what each rank is doing now. It prints again only when that picture changes, or every
    ``REPEAT`` seconds; the job keeps waiting (HPCGRAD_COMM_TIMEOUT still ends it). On a new
    stall rank 0 also asks every rank to write its flight record, and each rank writes its own
    when its own call has waited past the warning, so ``python -m hpcgrad.flight DIR`` has every
    live rank's record long before the timeout.

    Why messages and not an MPI window on rank 0: with MPICH ch4:ucx, ``Win.Lock(SHARED)/Get/
    Unlock`` on a rank computing outside MPI waited until it called MPI again (3.2 s for a
    3 s sleep: the lock needs the target's progress), and ``Win.Free`` is collective, so a
    window must be freed at exit by every rank together (left unfreed, UCX prints warnings at
    MPI_Finalize) -- which hangs a rank that leaves while another is stuck. A thread per rank
    sends without anyone's help: a rank stuck in a blocking MPI call has released the GIL, a
    rank computing in Python yields it every 5 ms. Nothing needs freeing at exit: ``stop``
    (registered with atexit, so before mpi4py's MPI_Finalize) only ends the threads.

    Every rank must register the same groups in the same order with the recorder. The
    warning is agreed by ``start`` (Note [One stall warning]).

Note [Diagnostics messages are data]
    Nothing another rank sends the stall inspector is unpickled: a pickle runs whatever
    callable its bytes name (``__reduce__``), so a diagnostics channel that unpickled would let
    anything able to send on it run code in every rank 0. A state is UTF-8 JSON of plain lists
    (``encode_state``), a dump request UTF-8 text; ``decode_state`` checks every field's type
    and refuses anything else (ValueError), and the inspector says so once per sending rank and
    carries on. JSON costs a little more than pickle, once a second per rank.

Note [Group names]
    A group is printed by the name it was registered under with the recorder ("group
    default", "group new_group([0, 1])", "group DDP(default)" for DDP's private communicator),
    never by its id alone: ids are registration order, and DDP's communicator reading as
    "group 0" made a DDP divergence look like the default group's. Only a group registered
    without a name reads "group 3"; a name two groups share gets its id too ("group
    DDP(default) [id 2]"). ``group_label`` here and ``_group_label`` in hpcgrad/flight.py
    (which reads files only, so imports nothing of this module) print the same words.

Note [One stall warning]
    HPCGRAD_STALL_WARNING is read on every rank, and ranks of one job may see different
    environments (a per-rank wrapper, a host's profile). With rank 0 inspecting at its own
    60 s and rank 1 asking for 1 s, a stall was silent for the 1 s rank's user; with 0 (off) on
    one rank, ``start`` duplicated the communicator on the others only and the job hung. So
    ``start`` gathers every rank's setting first (an Allgather of one float64: raw numbers,
    never pickle) and every rank then uses the SMALLEST SETTING THAT IS ON: a rank that asks
    to hear about a stall after N s is never left waiting silently past N s, whichever rank it
    is; the inspector is off only when every rank sets 0. Rank 0 says so in one line when the
    settings differ. A setting that is not a number is refused on every rank (ValueError),
    not on the one rank that read it while the others wait in the gather.
"""

import atexit
import json
import math
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from hpcgrad.base import config

from hpcgrad.comm.flight_recorder import RECORDER

WARNING_ENV = "HPCGRAD_STALL_WARNING"
DEFAULT_WARNING = 60.0
REPEAT = 300.0  # seconds before the same picture is printed again
HEARTBEAT = 10  # intervals between sends when nothing changed (rank 0 sees the rank is alive)
_STATE_TAG, _DUMP_TAG = 1, 2


def warning_from_env():
    """Seconds a collective may wait before rank 0 reports it (HPCGRAD_STALL_WARNING; 0: off)."""
    raw = config.raw(WARNING_ENV).strip()
    if raw == "":
        return DEFAULT_WARNING
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{WARNING_ENV} must be a number of seconds >= 0 (0 turns the stall "
                         f"inspector off), got {raw!r}")
    return value


def _ranks(ranks):
    """'rank 2' or 'ranks 0, 1'."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _span(ranks):
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def group_label(gid, groups):
    """'group DDP(default)', or 'group 3' for a group registered without a name (Note
    [Group names]); ``groups``: the recorder's [(name, world ranks)] by id."""
    if not 0 <= gid < len(groups):
        return f"group {gid} (not registered on rank 0)"
    name = groups[gid][0]
    if name == str(gid):
        return f"group {gid}"
    shared = sum(1 for other, _ in groups if other == name) > 1
    return f"group {name}" + (f" [id {gid}]" if shared else "")


def describe_call(call, groups):
    """'allreduce #5 (4 x float32) on group default' or 'recv from rank 1 (...) on group 3'."""
    if call["peer"] is None:
        what = f"{call['op']} #{call['collective']}"
    else:
        direction = "to" if call["op"] == "send" else "from"
        what = f"{call['op']} {direction} rank {call['peer']}"
    return f"{what} ({call['count']} x {call['dtype']}) on {group_label(call['group'], groups)}"


def activity(state, groups, now):
    """What a rank is doing, from its published state: its oldest call still in progress, or
    how long it has been outside communication and its last call."""
    if state is None:
        return "no report yet (its stall thread has not sent one)"
    calls = [c for c in state["groups"].values()] + ([state["p2p"]] if state["p2p"] else [])
    posted = [c for c in calls if c["state"] == "posted"]
    stale = now - state["sent"]
    # An unchanged state is sent again every HEARTBEAT intervals: older means not heard from.
    note = f" (as of {stale:.0f} s ago)" if stale > (HEARTBEAT + 2) * state["interval"] else ""
    if posted:
        call = min(posted, key=lambda c: c["start"])
        return f"waiting in {describe_call(call, groups)} for {now - call['start']:.1f} s{note}"
    if not calls:
        return f"no communication call yet{note}"
    call = max(calls, key=lambda c: c["end"] or c["start"])
    return (f"not in a communication call for {now - (call['end'] or call['start']):.1f} s; last: "
            f"{describe_call(call, groups)}, {call['state']}{note}")


def find_stall(states, groups, now, warning):
    """The stalled collective, or None: the call (group, number) some member has waited in
    longest, past ``warning`` s. ``states``: rank -> published state (None: not heard from).
    Returns a dict: group, collective, call, waiting {rank: seconds}, behind, done, silent."""
    worst = None
    for rank, state in states.items():
        for gid, call in (state["groups"].items() if state else ()):
            waited = now - call["start"]
            if call["state"] == "posted" and waited > warning and (
                    worst is None or call["start"] < worst[2]["start"]):
                worst = (gid, call["collective"], call)
    if worst is None:
        return None
    gid, number, call = worst
    members = groups[gid][1] if gid < len(groups) else sorted(states)
    found = {"group": gid, "collective": number, "call": call, "waiting": {}, "behind": [],
             "done": [], "silent": []}
    for rank in members:
        state = states.get(rank)
        mine = state["groups"].get(gid) if state else None
        if state is None:
            found["silent"].append(rank)
        elif mine is None or mine["collective"] < number:
            found["behind"].append(rank)
        elif mine["collective"] == number and mine["state"] == "posted":
            found["waiting"][rank] = now - mine["start"]
        else:
            found["done"].append(rank)
    return found


def stall_report(stall, states, groups, now, warning, flight_dir):
    """The block rank 0 prints for ``stall`` (from find_stall)."""
    gid, number = stall["group"], stall["collective"]
    members = groups[gid][1] if gid < len(groups) else sorted(states)
    call = stall["call"]
    waiting = stall["waiting"]
    longest = max(waiting.values()) if waiting else now - call["start"]
    head = (f"[hpcgrad stall inspector] {call['op']} #{number} ({call['count']} x "
            f"{call['dtype']}) on {group_label(gid, groups)} (world ranks {_span(members)}) has waited "
            f"{longest:.1f} s on {_ranks(waiting)}")
    missing = stall["behind"] + stall["silent"]
    if missing:
        head += f"; not reached by {_ranks(missing)}"
    else:
        head += "; every rank reached it, yet it has not completed"
        ops = {(states[r]["groups"][gid]["op"], states[r]["groups"][gid]["count"],
                states[r]["groups"][gid]["dtype"]) for r in waiting}
        if len(ops) > 1:
            head += " (the ranks called different operations or sizes)"
    lines = [head + f" (over {WARNING_ENV}={warning:g} s)."]
    for rank in members:
        lines.append(f"  rank {rank}: {activity(states.get(rank), groups, now)}")
    lines.append(f"  The job keeps waiting ({'HPCGRAD_COMM_TIMEOUT'} ends it). Every rank's "
                 f"flight record: python -m hpcgrad.flight {flight_dir}")
    return "\n".join(lines)


_FIELDS = ("slot", "group", "seq", "collective", "op", "peer", "count", "dtype", "state",
           "start", "end")
MAX_SENT_GROUPS = 64  # a state stays a few KB: an eager message, complete without rank 0


MAX_MESSAGE = 64 * 1024  # bytes: anything larger is not a state this module sent
_STATES = ("posted", "complete", "failed")


def encode_state(state):
    """A published state as UTF-8 JSON of lists (Note [Diagnostics messages are data])."""
    calls = list(state["groups"].values())[:MAX_SENT_GROUPS]
    p2p = state["p2p"]
    packed = [state["sent"], state["interval"], [[c[f] for f in _FIELDS] for c in calls],
              None if p2p is None else [p2p[f] for f in _FIELDS]]
    return json.dumps(packed, separators=(",", ":")).encode()


def _is_int(value, none=False):
    return type(value) is int or (none and value is None)


def _is_time(value, none=False):
    return (type(value) in (int, float) and math.isfinite(value)) or (none and value is None)


_CHECKS = (("slot", _is_int), ("group", lambda v: _is_int(v) and v >= 0), ("seq", _is_int),
           ("collective", lambda v: _is_int(v, none=True)), ("op", lambda v: type(v) is str),
           ("peer", lambda v: _is_int(v, none=True)), ("count", _is_int),
           ("dtype", lambda v: type(v) is str), ("state", lambda v: v in _STATES),
           ("start", _is_time), ("end", lambda v: _is_time(v, none=True)))


def _call_from(fields):
    if type(fields) is not list or len(fields) != len(_CHECKS):
        raise ValueError(f"a call must be a list of {len(_CHECKS)} fields, got "
                         f"{type(fields).__name__}")
    for (name, check), value in zip(_CHECKS, fields):
        if not check(value):
            raise ValueError(f"field {name!r} of a call is {value!r}")
    return dict(zip(_FIELDS, fields))


def decode_state(data):
    """The state in ``data`` (bytes from ``encode_state``); raises ValueError for anything
    else (it is JSON and every field has its type, or it is refused: no code runs)."""
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"{len(data)} bytes, more than a state's {MAX_MESSAGE}")
    packed = json.loads(bytes(data).decode("utf-8"))  # ValueError on anything not JSON
    if type(packed) is not list or len(packed) != 4:
        raise ValueError(f"a state is a list of 4 items, got {type(packed).__name__}")
    sent, interval, calls, p2p = packed
    if not (_is_time(sent) and _is_time(interval) and interval > 0 and type(calls) is list
            and len(calls) <= MAX_SENT_GROUPS):
        raise ValueError("a state's time, interval or call list is malformed")
    calls = [_call_from(c) for c in calls]
    return {"groups": {c["group"]: c for c in calls},
            "p2p": None if p2p is None else _call_from(p2p), "sent": sent,
            "interval": interval}


def p2p_stall_report(states, groups, now, warning):
    """When no collective stalls: the ranks waiting in a send or receive past ``warning`` s,
    and what their peers are doing; None if there are none."""
    waits = sorted((rank, state["p2p"]) for rank, state in states.items()
                   if state and state["p2p"] and state["p2p"]["state"] == "posted"
                   and now - state["p2p"]["start"] > warning)
    if not waits:
        return None, None
    head = f"[hpcgrad stall inspector] point-to-point calls have waited over {WARNING_ENV}="
    lines = [f"{head}{warning:g} s:"]
    for rank, call in waits:
        members = groups[call["group"]][1] if call["group"] < len(groups) else []
        peer = members[call["peer"]] if 0 <= call["peer"] < len(members) else call["peer"]
        lines.append(f"  rank {rank}: waiting in {describe_call(call, groups)} for "
                     f"{now - call['start']:.1f} s; (world) rank {peer}: "
                     f"{activity(states.get(peer), groups, now)}")
    return "\n".join(lines), tuple((rank, call["slot"]) for rank, call in waits)


def _picture(stall):
    """What must change before the block is printed again."""
    return (stall["group"], stall["collective"], tuple(sorted(stall["waiting"])),
            tuple(stall["behind"]), tuple(stall["done"]), tuple(stall["silent"]))


class StallInspector:
    """The per-rank thread of Note [Stall inspector]; rank 0's also reads and reports."""

    def __init__(self, comm, warning, recorder=RECORDER, interval=None, out=None):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.warning = warning
        self.interval = interval or min(1.0, max(0.05, warning / 4))
        self.recorder = recorder
        self.out = out or sys.stderr
        self.states = {}  # rank 0: rank -> the latest state it sent
        self.reports = []  # rank 0: the blocks printed (tests read them)
        self._stop = threading.Event()
        self._own_dumped = None  # the call this rank last dumped for
        self._printed = (None, 0.0)  # (picture, when)
        self._send = None  # (request, bytes): the pending Isend of this rank's state
        self._requests = []  # rank 0: pending dump requests, each (request, bytes)
        self._refused = set()  # ranks whose malformed messages were reported
        self._thread = threading.Thread(target=self._run, name="hpcgrad-stall-inspector",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout=5.0):
        """End the thread (nothing to free: the communicator is left to MPI_Finalize)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self):
        last_sent, unchanged = None, 0
        while not self._stop.wait(self.interval):
            try:
                groups, p2p = self.recorder.latest()
                now = time.time()
                mine = {"groups": groups, "p2p": p2p, "sent": now, "interval": self.interval}
                self._check_own(mine, now)
                if self.rank == 0:
                    self.states[0] = mine
                    self._receive()
                    self._inspect(time.time())
                else:
                    self._poll_dump_requests()
                    key = (repr(groups), repr(p2p))
                    unchanged += 1
                    due = key != last_sent or unchanged >= HEARTBEAT
                    if due and (self._send is None or self._send[0].Test()):
                        data = encode_state(mine)
                        self._send = (self.comm.Isend([data, MPI.BYTE], 0, _STATE_TAG), data)
                        last_sent, unchanged = key, 0
            except Exception as exc:  # noqa: BLE001 - diagnostics must never take a job down
                if self._stop.is_set() or MPI.Is_finalized():
                    return
                sys.stderr.write(f"[hpcgrad stall inspector] rank {self.rank}: stopped after "
                                 f"{type(exc).__name__}: {exc}\n")
                return

    def _check_own(self, mine, now):
        """Write this rank's flight record once per call that waits past the warning."""
        calls = list(mine["groups"].values()) + ([mine["p2p"]] if mine["p2p"] else [])
        for call in calls:
            if call["state"] == "posted" and now - call["start"] > self.warning:
                key = (call["group"], call["slot"])
                if key != self._own_dumped:
                    self._own_dumped = key
                    self.recorder.dump(f"stall: {describe_call(call, self.recorder.groups())} "
                                       f"has waited {now - call['start']:.1f} s")
                return

    def _next_message(self, source, tag):
        """(source, bytes) of the next pending message, or None (Note [Diagnostics messages
        are data]: received as raw bytes, never unpickled)."""
        status = MPI.Status()
        message = self.comm.improbe(source, tag, status)
        if message is None:
            return None
        data = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([data, MPI.BYTE])
        return status.Get_source(), bytes(data)

    def _refuse(self, source, what, exc):
        if source not in self._refused:  # once per rank: a flood must not bury the reports
            self._refused.add(source)
            self.out.write(f"[hpcgrad stall inspector] rank {self.rank}: ignored a {what} from "
                           f"rank {source} that is not one ({exc}); diagnostics messages are "
                           f"data, never code\n")
            self.out.flush()

    def _poll_dump_requests(self):
        while (got := self._next_message(0, _DUMP_TAG)) is not None:
            source, data = got
            try:
                if len(data) > MAX_MESSAGE:
                    raise ValueError(f"{len(data)} bytes")
                reason = data.decode("utf-8")
            except ValueError as exc:  # UnicodeDecodeError included
                self._refuse(source, "dump request", exc)
                continue
            self.recorder.dump(reason)

    def _receive(self):
        while (got := self._next_message(MPI.ANY_SOURCE, _STATE_TAG)) is not None:
            source, data = got
            try:
                self.states[source] = decode_state(data)
            except ValueError as exc:
                self._refuse(source, "state message", exc)

    def _inspect(self, now):
        groups = self.recorder.groups()
        states = {rank: self.states.get(rank) for rank in range(self.size)}
        stall = find_stall(states, groups, now, self.warning)
        if stall is None:
            text, picture = p2p_stall_report(states, groups, now, self.warning)
            if picture is not None and picture != self._printed[0]:
                self._printed = (picture, now)
                self.reports.append(text)
                self.out.write(text + "\n")
                self.out.flush()
            elif picture is None:
                self._printed = (None, 0.0)
            return
        picture = _picture(stall)
        if picture == self._printed[0] and now - self._printed[1] < REPEAT:
            return
        new_stall = self._printed[0] is None or self._printed[0][:2] != picture[:2]
        self._printed = (picture, now)
        text = stall_report(stall, states, groups, now, self.warning, self.recorder.directory)
        self.reports.append(text)
        self.out.write(text + "\n")
        self.out.flush()
        if new_stall:
            reason = (f"stall reported by rank 0: {stall['call']['op']} #{stall['collective']} "
                      f"on {group_label(stall['group'], groups)}")
            self.recorder.dump(reason)
            self._requests = [(r, d) for r, d in self._requests if not r.Test()]
            data = reason.encode()
            self._requests += [(self.comm.Isend([data, MPI.BYTE], rank, _DUMP_TAG), data)
                               for rank in range(1, self.size)]


def _seconds(warning):
    return f"{warning:g} s" if warning else "0 (off)"


def agree_warning(comm, warning=None, out=None):
    """The warning every rank of ``comm`` uses (Note [One stall warning]): the smallest of the
    ranks' settings that is on, 0 when every rank is off. Collective; ``warning`` None reads
    HPCGRAD_STALL_WARNING. Rank 0 writes one line to ``out`` (stderr) when the ranks differ."""
    error = None
    if warning is None:
        try:
            warning = warning_from_env()
        except ValueError as exc:
            error, warning = exc, float("nan")
    every = np.empty(comm.Get_size(), np.float64)
    comm.Allgather(np.array([warning], np.float64), every)
    bad = [rank for rank, value in enumerate(every.tolist()) if not value >= 0]
    if bad:
        if error is not None:
            raise error
        raise ValueError(f"{WARNING_ENV} on {_ranks(bad)} is not a number of seconds >= 0 (0 "
                         f"turns the stall inspector off); set it to one such value on every rank")
    on = [value for value in every.tolist() if value > 0]
    agreed = min(on) if on else 0.0
    values = sorted(set(every.tolist()))
    if len(values) > 1 and comm.Get_rank() == 0:
        said = "; ".join(f"{_seconds(value)} on {_ranks(np.flatnonzero(every == value).tolist())}"
                         for value in values)
        out = sys.stderr if out is None else out
        out.write(f"[hpcgrad stall inspector] {WARNING_ENV} differs across ranks ({said}); "
                  f"every rank uses the smallest setting that is on: "
                  f"{_seconds(agreed)} (set the same value on every "
                  f"rank to silence this line)\n")
        out.flush()
    return agreed


_inspector = None
_lock = threading.Lock()


def start(comm, recorder=RECORDER, warning=None, out=None):
    """Start the stall inspector on every rank of ``comm``. Collective: every rank calls it,
    with the same ``comm``; the ranks agree on one warning (Note [One stall warning]; each
    rank's ``warning``, None: its HPCGRAD_STALL_WARNING) and, when it is not 0, duplicate
    ``comm``. Returns the inspector, or None when off or alone. Idempotent (every rank must
    have called ``stop()`` before a new ``start``); stopped at exit (atexit) or by ``stop()``."""
    global _inspector
    with _lock:
        if _inspector is not None:
            return _inspector
        if comm.Get_size() == 1:
            if warning is None:
                warning_from_env()  # a bad setting is an error in every job
            return None
        warning = agree_warning(comm, warning, out)
        if not warning:
            return None
        _inspector = StallInspector(comm.Dup(), warning, recorder, out=out)
        atexit.register(stop)
        return _inspector


def stop():
    """Stop the inspector's thread (local; call it on every rank before a new ``start``)."""
    global _inspector
    with _lock:
        inspector, _inspector = _inspector, None
    if inspector is not None:
        inspector.stop()
