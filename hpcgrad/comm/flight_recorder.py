"""The flight recorder: a ring buffer of each rank's last communication calls, dumped on failure.

Note [Flight recorder]
    Always on (HPCGRAD_FLIGHT_RECORDER=N entries, default 2000; 0: dumps hold no entries, and a
    ring of 64 is kept for the stall inspector alone). Every communication call is bracketed by

        slot = RECORDER.begin(group_id, seq, op, peer, array)   # before MPI sees the call
        RECORDER.end(slot)                                      # once it completed
        RECORDER.end(slot, ok=False)                            # it failed or timed out

    which store one tuple each in a preallocated ring (no lock, nothing else allocated). The
    stall inspector (hpcgrad/comm/stall.py) reads each rank's latest calls from the ring in its
    own thread, so publishing costs the hot path nothing. Figures: ``python
    benchmarks/flight.py``. ``RECORDER.dump(reason)`` writes
    ``flight_rank{R}.json`` into HPCGRAD_FLIGHT_DIR (default ./hpcgrad-flight) and never raises;
    ``python -m hpcgrad.flight DIR`` merges the ranks' dumps, names the rank that diverged and
    the ranks that left no dump (the world size in each dump says which ranks to expect).

    Where the calls go (hpcgrad/comm/process_group.py, work.py, mpi.py, collectives/api.py):
    - Groups: ``gid = RECORDER.register_group(world_ranks, name)`` on EVERY rank, in the same
      order, for every group whose calls are recorded: in ProcessGroup.__init__ for the default
      group, and in new_group BEFORE the Split, on members and non-members alike (ids must agree
      across ranks: the stall inspector compares ranks by them). Internal communicators (the
      DDP reducer's Dup, a DETAIL checker) may be registered too, with their own names.
    - Nonblocking path ``ProcessGroup._work``: ``slot = begin(gid, self._seq, name, peer,
      array)`` after numbering the call and before the Work is built (the MPI call is already
      posted: begin right before posting is better, but ``_work`` is the one place all
      nonblocking calls pass); keep ``slot`` in the Work (a slot in ``__slots__``).
    - Work completion: ``end(slot)`` in ``Work._complete``; ``end(slot, ok=False)`` where
      ``wait_requests`` raises CommTimeoutError in ``Work.wait`` (before re-raising).
    - Blocking path ``ProcessGroup._blocking`` and ``allreduce_now``: ``slot = begin(...)``
      next to ``self._inflight = ...``; ``end(slot)`` after the MPI call returns,
      ``end(slot, ok=False)`` in an ``except BaseException`` around it (then re-raise).
    - Point to point (isend/irecv go through ``_work``): pass ``peer``; ``probe_source`` may
      record op "probe" with peer -1.
    - The stall inspector: ``stall.start(world_comm)`` on every rank in init_process_group,
      after the default group is registered (collective: the ranks agree on one warning,
      Note [One stall warning] in stall.py, then Dup the communicator); and
      ``stall.stop()`` in destroy_process_group (local; atexit also calls it).
    Where to dump (each in a ``try`` already: dump never raises, it logs):
    - CommTimeoutError: where wait_requests raises it, ``RECORDER.dump(f"timeout: {msg}")``.
    - The watchdog's ``_abort_job`` and the abort-on-exception hook in mpi.py, before
      MPI_Abort: ``RECORDER.dump("abort: ...")`` (the other ranks die with the abort, so the
      ranks that time out themselves are the ones that leave dumps: keep timeouts equal).
    - SIGUSR2: ``install_signal_handler()`` from the main thread, at init_process_group AND
      at init_rpc (idempotent: either may come first). It and ``dump`` need no process group
      (an RPC-only job, or a program before init_process_group: the record then lists no
      groups); it dumps even while the main thread is blocked inside MPI. Until a program
      installs it, SIGUSR2's default action ends the process.
    - A stall: the stall inspector dumps each rank's own record when its call has waited past
      HPCGRAD_STALL_WARNING (stall.py).
    Threads: begin takes its slot from an ``itertools.count`` (atomic under the GIL), so two
    threads never share a slot, and each store of a tuple into a list is atomic; the
    collective counter of a group has one writer (the thread issuing the group's calls, which
    MPI's ordering rule asks for anyway). Readers (dump, the stall inspector) copy the lists
    first. ``end`` may run on another thread (the progress thread completing a Work).

Note [Job ids]
    Dumps of two runs written to one directory looked like one job whose ranks disagreed: rank
    0's record of a run two minutes later beside rank 1's of an earlier one, and the reader
    reported a divergence that never happened. So every record names its job, and
    ``python -m hpcgrad.flight`` refuses to merge records of different jobs (``--job`` picks
    one). The ranks agree on the name at start-up (``agree_job_id``: one broadcast from rank 0
    in init_process_group and again in init_rpc, rank 0 proposing what it already agreed on,
    so a default group of fewer ranks and RPC over all of them share it): the launcher's name for the
    job where it has one (SLURM_JOB_ID.SLURM_STEP_ID, Open MPI's PMIx namespace), which alone
    would not tell apart two mpiexec runs inside one allocation, followed by rank 0's host,
    process id and start time, which would. A record written before start-up has the
    launcher's name only (or none: MPICH's hydra gives none), and says so.
"""

import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time

import numpy as np

from hpcgrad.base import config
from hpcgrad.base.config import whole_number
from hpcgrad.comm.mpi import before_abort, comm_world

CAPACITY_ENV = "HPCGRAD_FLIGHT_RECORDER"
DIR_ENV = "HPCGRAD_FLIGHT_DIR"
DEFAULT_CAPACITY = 2000
DEFAULT_DIR = "hpcgrad-flight"
FORMAT_VERSION = 1

_now = time.time
_MIN_RING = 64  # with the recorder off, the stall inspector still reads the latest calls
_MAX_EVENTS = 32  # events of the job kept (recoveries): a few per job


def capacity_from_env():
    """Ring entries from HPCGRAD_FLIGHT_RECORDER (default 2000; 0: dumps hold no entries)."""
    return whole_number(CAPACITY_ENV, 0, "a whole number of entries >= 0 (0 turns the flight "
                        "recorder off)", DEFAULT_CAPACITY)


def _log(message):
    """Failure paths call the recorder: it reports its own trouble on stderr, never raises."""
    try:
        sys.stderr.write(f"[hpcgrad flight recorder] {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr itself may be closed at exit
        return


class FlightRecorder:
    """The last ``capacity`` communication calls of this process (Note [Flight recorder])."""

    def __init__(self, capacity, rank=0, world_size=1, directory=None):
        self.capacity = capacity
        self.rank, self.world_size = rank, world_size
        self.directory = os.path.abspath(directory or config.raw(DIR_ENV) or DEFAULT_DIR)
        self._n = max(capacity, _MIN_RING)
        # Entry: (slot, group, seq, collective number or 0, op, peer, count, dtype, start).
        self._ring = [(-1, 0, 0, 0, "", None, 0, None, 0.0)] * self._n
        # (slot, end time): > 0 completed, < 0 failed; a slot other than the entry's: posted.
        self._ends = [(-1, 0.0)] * self._n
        self._counter = itertools.count()
        self._coll = []  # per group: collectives recorded so far
        self._p2p_slot = -1  # the latest point-to-point call's slot
        self._groups = []  # per group: (name, world ranks)
        self._dump_lock = threading.RLock()  # a signal may interrupt a dump on the same thread
        self._dumps = itertools.count()
        self.job_id = launcher_job_id()  # until the ranks agree on one: Note [Job ids]
        self.job_agreed = False
        self._events = collections.deque(maxlen=_MAX_EVENTS)  # what happened to the job

    # --- groups -----------------------------------------------------------------------------
    def register_group(self, ranks, name=None):
        """A small id for a group of world ``ranks``; every rank registers every group in the
        same order (as new_group is called), members or not, so ids agree across ranks."""
        gid = len(self._groups)
        self._groups.append((str(gid if name is None else name), [int(r) for r in ranks]))
        self._coll.append(0)
        return gid

    def groups(self):
        """[(name, world ranks)] by group id."""
        return list(self._groups)

    # --- the hot path -----------------------------------------------------------------------
    # Note [Cost per call] (process_group.py) applies: begin and end each build one tuple and
    # read the clock once, nothing else is allocated, no lock, no branch beyond collective or
    # point-to-point. The stall inspector's thread reads the ring: nothing is published here.
    def begin(self, group, seq, op, peer, array):
        """Record a call of group id ``group`` (its call number ``seq``) with ``array`` (for its
        size and dtype; a barrier passes an empty array), ``peer`` None for a collective.
        Returns the slot for ``end``."""
        slot = next(self._counter)
        if peer is None:
            coll = self._coll[group] + 1
            self._coll[group] = coll
        else:
            coll = 0
            self._p2p_slot = slot
        self._ring[slot % self._n] = (slot, group, seq, coll, op, peer, array.size, array.dtype,
                                      _now())
        return slot

    def end(self, slot, ok=True):
        """Mark the call of ``slot`` completed (or failed, ``ok=False``). A slot the ring has
        since reused keeps its new entry's state: the end carries its slot."""
        self._ends[slot % self._n] = (slot, _now() if ok else -_now())

    def event(self, what, **details):
        """Keep an event of the job itself (an elastic recovery: old and new size, lost ranks),
        not a call: every later record lists the last few, with their time."""
        self._events.append({"time": _now(), "what": str(what), **details})

    # --- reading ----------------------------------------------------------------------------
    def _next_slot(self):
        # itertools.count's repr is the only way to read it without advancing it.
        text = repr(self._counter)
        return int(text[text.index("(") + 1:text.rindex(")")])

    @staticmethod
    def _as_dict(entry, end_entry, now=None):
        slot, group, seq, coll, op, peer, count, dtype, start = entry
        end = end_entry[1] if end_entry[0] == slot else 0.0
        return {"slot": slot, "group": group, "seq": seq,
                "collective": coll if peer is None else None, "op": op, "peer": peer,
                "count": int(count), "dtype": str(dtype),
                "state": "posted" if end == 0.0 else "complete" if end > 0 else "failed",
                "start": start, "end": abs(end) if end else None}

    def entries(self, limit=None):
        """The last ``limit`` (default: capacity) recorded calls, oldest first, as dicts."""
        limit = self.capacity if limit is None else min(limit, self._n)
        ring, ends = list(self._ring), list(self._ends)  # a snapshot: other threads go on
        last = self._next_slot()
        out = []
        for slot in range(max(0, last - limit), last):
            k = slot % self._n
            if ring[k][0] == slot:  # else reserved by a begin not yet stored
                out.append(self._as_dict(ring[k], ends[k]))
        return out

    def latest(self):
        """This rank's latest call on each group and its latest point-to-point call, as
        ({group id: call dict}, call dict or None): what the stall inspector publishes.
        Walks back from the newest entry only until every group that has called is found."""
        ring, ends, n = self._ring, self._ends, self._n
        wanted = sum(1 for count in self._coll if count)
        p2p, k = None, self._p2p_slot % n
        if self._p2p_slot >= 0 and ring[k][0] == self._p2p_slot:
            p2p = self._as_dict(ring[k], ends[k])
        groups, last = {}, self._next_slot()
        for slot in range(last - 1, max(-1, last - 1 - n), -1):
            if len(groups) >= wanted:
                break
            entry = ring[slot % n]
            if entry[0] == slot and entry[5] is None and entry[1] not in groups:
                groups[entry[1]] = self._as_dict(entry, ends[slot % n])
        return groups, p2p

    def snapshot(self, reason):
        """What ``dump`` writes, as a dict."""
        return {"version": FORMAT_VERSION, "rank": self.rank, "world_size": self.world_size,
                "job": self.job_id, "job_agreed": self.job_agreed, "host": socket.gethostname(), "pid": os.getpid(), "reason": str(reason),
                "time": _now(), "capacity": self.capacity,
                "recorded": self._next_slot(), "events": list(self._events),
                "groups": [{"id": gid, "name": name, "ranks": ranks}
                           for gid, (name, ranks) in enumerate(self._groups)],
                "entries": self.entries()}


    def dump(self, reason):
        """Write flight_rank{R}.json (atomically) into the flight directory; returns its path,
        or None after logging why not. Never raises: it runs on failure paths."""
        tmp = None
        try:
            with self._dump_lock:
                record = self.snapshot(reason)
                os.makedirs(self.directory, exist_ok=True)
                path = os.path.join(self.directory, f"flight_rank{self.rank}.json")
                # Unique: a signal handler's dump may interrupt one on the same thread.
                tmp = f"{path}.tmp.{os.getpid()}.{next(self._dumps)}"
                with open(tmp, "w") as f:
                    f.write(_to_json(record))
                os.replace(tmp, path)
                return path
        except Exception as exc:  # noqa: BLE001 - a failing dump must not hide the real error
            _log(f"rank {self.rank}: could not write the flight record ({reason}): "
                 f"{type(exc).__name__}: {exc}")
            if tmp is not None:
                with contextlib.suppress(OSError):  # a full disk leaves no partial file
                    os.unlink(tmp)
            return None


def launcher_job_id(environ=None):
    """The launcher's name for this job where it gives one (SLURM's job and step, Open MPI's
    PMIx namespace), else None. MPICH's hydra gives none."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_ID"):
        step = environ.get("SLURM_STEP_ID")
        return f"slurm {environ['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    if environ.get("PMIX_NAMESPACE"):
        return f"pmix {environ['PMIX_NAMESPACE']}"
    return None


_JOB_ID_BYTES = 256


def agree_job_id(comm, recorder=None):
    """Collective over ``comm``: every rank takes rank 0's job id, the launcher's name for the
    job and rank 0's host, process and start time (Note [Job ids]). Rank 0 proposes the id it
    already agreed on, if any, so init_rpc after init_process_group (whose group may be
    fewer ranks) keeps the one name."""
    recorder = RECORDER if recorder is None else recorder
    if recorder.job_agreed:
        mine = recorder.job_id
    else:
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(_now()))
        mine = f"{socket.gethostname()} pid {os.getpid()} at {started}"
        if recorder.job_id:
            mine = f"{recorder.job_id}, {mine}"
    # Raw bytes, never pickle (as every diagnostics message: Note [Diagnostics messages are
    # data] in stall.py); a name longer than the buffer is cut, never sent in pieces.
    buffer = np.zeros(_JOB_ID_BYTES, np.uint8)
    encoded = mine.encode("utf-8")[:_JOB_ID_BYTES]
    buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    comm.Bcast(buffer, root=0)
    recorder.job_id = bytes(buffer).rstrip(b"\0").decode("utf-8", errors="replace")
    recorder.job_agreed = True
    return recorder.job_id


def _to_json(record):
    """The record with one entry per line: readable, and a fifth of indented JSON's size."""
    head = {key: value for key, value in record.items() if key != "entries"}
    entries = "".join(f"\n  {json.dumps(entry)}," for entry in record["entries"])
    return f"{json.dumps(head)[:-1]},\n \"entries\": [{entries.rstrip(',')}\n ]}}\n"


def _new_recorder():
    # A bad HPCGRAD_FLIGHT_RECORDER is an error at import, as every hpcgrad setting is: a
    # silent default would leave a user who asked for a larger ring without it.
    world = comm_world()
    return FlightRecorder(capacity_from_env(), world.Get_rank(), world.Get_size())


RECORDER = _new_recorder()
before_abort(RECORDER.dump)  # every abort path of comm/mpi.py writes this rank's record

_signal_state = {"thread": None, "previous": None}


_SIGUSR2 = getattr(signal, "SIGUSR2", None)  # absent on Windows


def install_signal_handler(recorder=None, signum=_SIGUSR2):
    """Make ``signum`` (SIGUSR2) dump ``recorder`` (RECORDER) on demand; returns True if done.

    A Python signal handler runs only when the main thread is back in the interpreter, never
    while it is blocked inside MPI (the case worth a dump), so the C-level handler's wakeup fd
    (``signal.set_wakeup_fd``) wakes a daemon thread that dumps. When the program already uses
    the wakeup fd (asyncio), the Python handler dumps instead, once the main thread returns.
    Nothing here touches MPI or needs a process group (Note [Flight recorder]: init_rpc and
    init_process_group both call it). Call it from the main thread; idempotent.
    """
    recorder = recorder or RECORDER
    if signum is None or threading.current_thread() is not threading.main_thread():
        return False
    if _signal_state["thread"] is not None:
        return True
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_handler = signal.getsignal(signum)

        def on_signal(number, frame):
            # The thread has dumped already, unless the wakeup fd is no longer ours (asyncio
            # took it): read it by swapping (this runs in the main thread, as it must).
            current = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(current)
            if current != write_fd or not _signal_state["thread"]:
                recorder.dump(f"signal {signal.Signals(number).name}")
            if callable(previous_handler):
                previous_handler(number, frame)

        signal.signal(signum, on_signal)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone else's: give it back, keep the Python handler only
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            _signal_state["thread"] = False
            return True

        def wait_for_signals():
            while True:
                try:
                    data = os.read(read_fd, 64)
                except OSError:
                    return
                if not data:
                    return
                if signum in data:
                    recorder.dump(f"signal {signal.Signals(signum).name}")

        thread = threading.Thread(target=wait_for_signals, name="hpcgrad-flight-signal",
                                  daemon=True)
        _signal_state["thread"] = thread
        thread.start()
        return True
    except (OSError, ValueError) as exc:
        _log(f"could not install the {signal.Signals(signum).name} handler: {exc}")
        return False
