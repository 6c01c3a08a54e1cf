"""Rank 1 calls a collective with another dtype (or op, count, reduce op) than the other ranks.

    mpiexec -n 3 python tests/scripts/comm_dtype_mismatch.py   # the default checks (INFO)
    HPCGRAD_DISTRIBUTED_DEBUG=OFF mpiexec -n 2 python tests/scripts/comm_dtype_mismatch.py dtype

With INFO every rank raises CollectiveMismatchError (printed on one line, " | " for newlines) and
the group still works; without checks the float32/float64 all_reduce returns what MPI makes of
it, printed as is.
"""

import sys

import numpy as np

import hpcgrad.distributed as dist
from hpcgrad.distributed import CollectiveMismatchError, ReduceOp


def say(rank, text):
    sys.stdout.write(f"[rank {rank}] {text}\n")
    sys.stdout.flush()


def mismatched(kind, rank):
    odd = rank == 1
    x = np.ones(1000, np.float32 if odd and kind == "dtype" else np.float64)
    if kind == "op":
        dist.broadcast(x, 0) if odd else dist.all_reduce(x)
    elif kind == "count":
        dist.all_reduce(np.ones(999) if odd else x)
    elif kind == "reduce-op":
        dist.all_reduce(x, ReduceOp.MAX if odd else ReduceOp.SUM)
    else:
        dist.all_reduce(x)
    return x[:3].tolist()


def main():
    dist.init_process_group(timeout=10)
    rank = dist.get_rank()
    for kind in sys.argv[1:] or ["dtype", "op", "count", "reduce-op", "ok"]:
        try:
            got = mismatched(kind, rank)
        except CollectiveMismatchError as error:
            say(rank, f"{kind}: caught CollectiveMismatchError: "
                      f"{str(error).replace(chr(10), ' | ')}")
        else:
            say(rank, f"{kind}: no error, got {got}")
        y = np.full(2, rank + 1.0)
        dist.all_reduce(y)
        say(rank, f"{kind}: afterwards all_reduce gives {y.tolist()}")


if __name__ == "__main__":
    main()
