"""HPCGRAD_DISTRIBUTED_DEBUG: compare every rank's collective call before its data moves.

A rank that calls a different collective, or the same one with another count, dtype, root or
reduce op, would hang, crash MPICH or, with the nonblocking calls every collective posts,
return garbage with exit status 0; checked, every rank raises CollectiveMismatchError listing
each rank's call, and the refused call moves no data (the group still works).

- INFO (the default): the hash of a fingerprint of each call (call number, op, element count,
  dtype, root, reduce op: six integers) and its negation are all-reduced with MPI_MAX (16
  bytes) on a private communicator before the call's data is posted; the ranks agree when the
  two maxima are each other's negation. Only on a mismatch do the ranks gather their
  fingerprints to say who called what. Blocking calls wait for the check; asynchronous ones
  post their data when it has completed (Note [Checked collectives] in process_group.py).
  Its cost per call, from ``mpiexec -n 2 python benchmarks/checks.py``, is in
  docs/reliability.rst.
- OFF: no check, for raw speed. What is lost: a mismatch of element sizes (float32 against
  float64) still waits on two communicators (Note [Wide elements on their own communicator]
  in process_group.py) until the stall inspector and the timeout report it, but another op,
  count or root, or another dtype of the same size (float32 against int32, float16 against
  bfloat16), mixes the ranks' data silently or hangs.
- DETAIL: a 512-byte signature (the call's fields as JSON, the shape included) is
  all-gathered and compared as text, at the call: slower, and it also tells shapes apart
  that have the same element count.
"""

import json
from array import array as pyarray

import numpy as np
from mpi4py import MPI

from hpcgrad.base import config

from hpcgrad.comm.buffers import dtype_code, dtype_name
from hpcgrad.comm.work import wait_requests

_IN_PLACE = MPI.IN_PLACE

DEBUG_ENV = "HPCGRAD_DISTRIBUTED_DEBUG"
_LEVELS = ("OFF", "INFO", "DETAIL")
_SIGNATURE_BYTES = 512
# Codes of the INFO fingerprint (0: none).
_OPS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "barrier")
OP_CODES = {name: code for code, name in enumerate(_OPS, start=1)}
_REDUCE_OPS = ("sum", "avg", "min", "max", "product")
REDUCE_CODES = {name: code for code, name in enumerate(_REDUCE_OPS, start=1)}


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives (or with different shapes or dtypes)."""


def level():
    """HPCGRAD_DISTRIBUTED_DEBUG as 'OFF', 'INFO' or 'DETAIL' (default INFO)."""
    value = (config.raw(DEBUG_ENV).strip() or "INFO").upper()
    if value not in _LEVELS:
        raise ValueError(f"{DEBUG_ENV} must be OFF, INFO or DETAIL, got {value!r}")
    return value


def detail_enabled():
    return level() == "DETAIL"


def make_checker(comm, timeout):
    """The checker the debug level asks for (None when OFF), on a duplicate of ``comm``."""
    mode = level()
    if mode == "DETAIL":
        return CallChecker(comm, timeout)
    if mode == "INFO":
        return FingerprintChecker(comm, timeout)
    return None


def _mismatch(seq, calls):
    lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
    return CollectiveMismatchError(
        f"ranks called different collectives at call #{seq} (each rank must call the same "
        f"collectives in the same order with the same shapes and dtypes):\n{lines}")


class FingerprintChecker:
    """INFO (the default): each call's fingerprint is all-reduced on a private communicator
    before its data moves (Note [Checked collectives] in process_group.py)."""

    def __init__(self, comm, timeout):
        self.comm = comm.Dup()
        # Gathers after a mismatch run on their own communicator: a rank may have posted the
        # fingerprints of later (asynchronous) calls on ``comm`` before it sees the mismatch,
        # another not yet, but every rank sees the mismatches in the same order.
        self.describe_comm = comm.Dup()
        self.timeout = timeout

    def free(self):
        self.comm.Free()
        self.describe_comm.Free()

    @staticmethod
    def fingerprint(seq, name, array, extra):
        """Six integers naming a call: number, op, element count, dtype, root, reduce op."""
        root = extra.get("src", extra.get("dst", -1))
        return (seq, OP_CODES.get(name, 0), array.size, dtype_code(array.dtype), root,
                REDUCE_CODES.get(extra.get("reduce_op"), 0))

    def start(self, mine):
        """Post the all_reduce (MPI_MAX) of the hash of ``mine`` and its negation; returns
        (request, buffer). Equal maxima of h and -h mean every rank's h was the same."""
        # Python's hash of a tuple of ints is the same in every process (only str and bytes
        # hashes are salted); halved so that its negation fits in 64 bits. Two int64 in an
        # array.array cost ~1 us per call, the whole fingerprint in numpy ~25 us
        # (`mpiexec -n 2 python benchmarks/checks.py`); a mismatch then gathers the whole
        # fingerprints.
        h = hash(mine) >> 1
        both = pyarray("q", (h, -h))
        return self.comm.Iallreduce(_IN_PLACE, [both, MPI.INT64_T], MPI.MAX), both

    def verify(self, mine, both):
        """After the all_reduce: return if every rank's fingerprint equals ``mine``, else gather
        everyone's and raise CollectiveMismatchError (on every rank: all see the same maxima)."""
        if both[0] == -both[1]:
            return
        n = len(mine)
        everyone = np.zeros((self.describe_comm.Get_size(), n), np.int64)
        request = self.describe_comm.Iallgather([np.array(mine, np.int64), MPI.INT64_T],
                                                [everyone, MPI.INT64_T])
        wait_requests([request], self.timeout, lambda: f"call #{mine[0]}: gathering every "
                                                       f"rank's call after a mismatch")
        raise _mismatch(mine[0], [_describe(row) for row in everyone.tolist()])

    def check(self, seq, name, array, **extra):
        """The whole check at once (start, wait within the timeout, verify)."""
        mine = self.fingerprint(seq, name, array, extra)
        request, both = self.start(mine)
        wait_requests([request], self.timeout,
                      lambda: f"{name} #{seq} ({array.size} x {array.dtype}, shape "
                              f"{list(array.shape)}), at its call check,")
        self.verify(mine, both)


def _describe(fingerprint):
    seq, op, count, dtype, root, reduce_op = fingerprint
    text = f"{_OPS[op - 1] if op else '?'} #{seq}"
    if op != OP_CODES["barrier"]:
        text += f": {count} x {dtype_name(dtype)}"
    if reduce_op:
        text += f", op {_REDUCE_OPS[reduce_op - 1]}"
    if root >= 0:
        text += f", root {root}"
    return text


class CallChecker:
    """DETAIL: exchanges a fixed-size signature of each call on a private communicator."""

    def __init__(self, comm, timeout):
        self.comm = comm.Dup()
        self.timeout = timeout

    def free(self):
        self.comm.Free()

    def check(self, seq, name, array, **extra):
        call = dict(extra)  # e.g. src, dst, reduce_op; never overriding the fields below
        call.update(seq=seq, op=name, shape=list(array.shape), dtype=str(array.dtype))
        encoded = json.dumps(call, sort_keys=True).encode()
        if len(encoded) > _SIGNATURE_BYTES:
            raise ValueError(f"call signature too long to check: {encoded[:80]!r}...")
        mine = np.zeros(_SIGNATURE_BYTES, np.uint8)
        mine[:len(encoded)] = np.frombuffer(encoded, np.uint8)
        everyone = np.zeros((self.comm.Get_size(), _SIGNATURE_BYTES), np.uint8)
        request = self.comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE])
        wait_requests([request], self.timeout,
                      lambda: f"{name} #{seq} ({array.size} x {array.dtype}, shape "
                              f"{list(array.shape)}), at its call check,")
        calls = [row.tobytes().rstrip(b"\0").decode() for row in everyone]
        if len(set(calls)) > 1:
            raise _mismatch(seq, calls)
