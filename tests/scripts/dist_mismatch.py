"""Run with HPCGRAD_DISTRIBUTED_DEBUG=DETAIL: rank 1 makes a different call; every rank must raise.

    HPCGRAD_DISTRIBUTED_DEBUG=DETAIL mpiexec -n 3 python tests/scripts/dist_mismatch.py

One kind of mismatch after another (op, shape, dtype, reduce-op), then matching calls (ok).
Each rank prints one line per outcome (errors on one line, " | " for newlines, so the ranks'
output cannot interleave inside it), then shows the group still works: the refused call sent
nothing, so the ranks' call numbers still agree.
"""

import sys

import numpy as np

import hpcgrad.distributed as dist
from hpcgrad.distributed import CollectiveMismatchError, ReduceOp


def say(rank, text):
    sys.stdout.write(f"[rank {rank}] {text}\n")
    sys.stdout.flush()


def mismatched(kind, rank):
    """Call #k+2 for the k-th kind: the refused calls are not counted, the all_reduce after is."""
    x = np.zeros(4)
    odd = rank == 1
    if kind == "op":
        dist.broadcast(x, 0) if odd else dist.all_reduce(x)
    elif kind == "shape":
        dist.all_reduce(np.zeros(5) if odd else x)
    elif kind == "dtype":
        dist.all_reduce(x.astype(np.float32) if odd else x)
    elif kind == "reduce-op":
        dist.all_reduce(x, ReduceOp.MAX if odd else ReduceOp.SUM)
    elif kind == "ok":  # everything matches: DETAIL must not get in the way
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, {"rank": rank})
        assert out == [{"rank": r} for r in range(dist.get_world_size())]
        group = dist.new_group([0, dist.get_world_size() - 1])
        if group is not dist.NON_GROUP_MEMBER:
            dist.broadcast(x, dist.get_world_size() - 1, group=group)
        dist.barrier()
    else:
        raise SystemExit(f"unknown kind {kind!r}")


KINDS = ("op", "shape", "dtype", "reduce-op", "ok")


def main():
    world = dist.init_process_group()
    rank = dist.get_rank()
    assert world._checker is not None, "run with HPCGRAD_DISTRIBUTED_DEBUG=DETAIL"
    dist.all_reduce(np.ones(3))  # call #1 matches everywhere
    for kind in KINDS:
        try:
            mismatched(kind, rank)
        except CollectiveMismatchError as error:
            say(rank, f"{kind}: caught CollectiveMismatchError: "
                      f"{str(error).replace(chr(10), ' | ')}")
        else:
            say(rank, f"{kind}: no error")
        y = np.full(2, rank + 1.0)
        dist.all_reduce(y)
        say(rank, f"{kind}: afterwards all_reduce gives {y.tolist()}")


if __name__ == "__main__":
    main()
