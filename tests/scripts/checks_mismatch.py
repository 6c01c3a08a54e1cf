"""Rank 1 makes a collective call that differs from rank 0's (and rank 2's) in one field.

    mpiexec -n 2 python tests/scripts/checks_mismatch.py [CASE ...] [--async]

For each case every rank prints one line: the CollectiveMismatchError it caught (newlines as
" | "), or "no error" with what its array holds; then whether its own array is untouched (the
default checks run before any data moves, Note [Checked collectives]); then the result of a
matching all_reduce afterwards (the group must still work). With --async the calls are made
with async_op=True and the error comes from wait().
"""

import sys

import numpy as np

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad.distributed import CollectiveMismatchError

DTYPES = {  # case: (rank 0's dtype, rank 1's), same element count
    "float16-float32": (np.float16, np.float32),
    "int64-float64": (np.int64, np.float64),
    "complex64-float64": (np.complex64, np.float64),
    "bool-uint8": (np.bool_, np.uint8),
    "float32-int32": (np.float32, np.int32),
}


def say(rank, text):
    sys.stdout.write(f"[rank {rank}] {text}\n")
    sys.stdout.flush()


def call(case, rank, async_op, seen):
    """Make the case's call; ``seen``: (the array the call may write, a copy made before)."""
    odd = rank == 1
    wait = (lambda work: work.wait()) if async_op else (lambda work: None)
    if case == "all_reduce-count":
        x = hg.tensor(np.ones(12 if odd else 10, np.float32))
        seen.append((x.array, x.array.copy()))
        wait(dist.all_reduce(x, async_op=async_op))
        return
    if case == "all_gather-count":
        x = np.full(4 if odd else 3, rank + 1.0, np.float32)
        out = [np.zeros_like(x) for _ in range(dist.get_world_size())]
        seen.extend((o, o.copy()) for o in out)
        wait(dist.all_gather(out, x, async_op=async_op))
        return
    if case == "broadcast-count":
        x = np.full(12 if odd else 10, rank + 1.0, np.float32)
        seen.append((x, x.copy()))
        wait(dist.broadcast(x, 0, async_op=async_op))
        return
    if case == "broadcast-root":
        x = np.full(10, rank + 1.0, np.float32)
        seen.append((x, x.copy()))
        wait(dist.broadcast(x, 1 if odd else 0, async_op=async_op))
        return
    if case == "skipped-all_reduce":  # rank 1 skips the all_reduce and goes on to a barrier
        x = np.full(10, rank + 1.0, np.float32)
        seen.append((x, x.copy()))
        if not odd:
            wait(dist.all_reduce(x, async_op=async_op))
        wait(dist.barrier(async_op=async_op))
        return
    if case == "reduce-op":
        x = np.full(10, rank + 1.0, np.float32)
        seen.append((x, x.copy()))
        wait(dist.all_reduce(x, dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM,
                             async_op=async_op))
        return
    usual, other = DTYPES[case]
    x = np.ones(10, other if odd else usual)
    seen.append((x, x.copy()))
    wait(dist.all_reduce(x, async_op=async_op))


def main():
    args = [a for a in sys.argv[1:] if a != "--async"]
    async_op = "--async" in sys.argv
    dist.init_process_group(timeout=20)
    rank = dist.get_rank()
    for case in args:
        seen = []
        try:
            call(case, rank, async_op, seen)
        except CollectiveMismatchError as error:
            say(rank, f"{case}: caught CollectiveMismatchError: "
                      f"{str(error).replace(chr(10), ' | ')}")
        else:
            say(rank, f"{case}: no error, got {[a.tolist() for a, _ in seen]}")
            continue
        untouched = all(np.array_equal(a, b) for a, b in seen)
        say(rank, f"{case}: untouched {untouched}")
        y = np.full(2, rank + 1.0)
        dist.all_reduce(y)
        say(rank, f"{case}: afterwards all_reduce gives {y.tolist()}")


if __name__ == "__main__":
    main()
