"""HPCGRAD_DISTRIBUTED_DEBUG=DETAIL: compare every rank's collective call before running it.

A rank that calls a different collective, or the same one with another shape or dtype, would
hang or corrupt data silently; here every rank raises CollectiveMismatchError listing each
rank's call.
"""

import json
import os

import numpy as np
from mpi4py import MPI

from .work import wait_requests

DEBUG_ENV = "HPCGRAD_DISTRIBUTED_DEBUG"
_SIGNATURE_BYTES = 512


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives (or with different shapes or dtypes)."""


def detail_enabled():
    value = os.environ.get(DEBUG_ENV, "OFF").upper()
    if value not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"{DEBUG_ENV} must be OFF, INFO or DETAIL, got {value!r}")
    return value == "DETAIL"


class CallChecker:
    """Exchanges a fixed-size signature of each call on a private communicator."""

    def __init__(self, comm, timeout):
        self.comm = comm.Dup()
        self.timeout = timeout

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
                              f"{list(array.shape)}), at its {DEBUG_ENV}=DETAIL call check,")
        calls = [row.tobytes().rstrip(b"\0").decode() for row in everyone]
        if len(set(calls)) > 1:
            lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
            raise CollectiveMismatchError(
                f"ranks called different collectives at call #{seq} (each rank must call the "
                f"same collectives in the same order with the same shapes and dtypes):\n{lines}")
