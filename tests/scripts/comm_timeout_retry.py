"""Rank 1 skips an all_reduce; rank 0 catches the timeout and carries on: its next call must raise.

    mpiexec -n 2 python tests/scripts/comm_timeout_retry.py

Rank 0's timed-out Iallreduce stays posted in MPI (a collective cannot be cancelled), and rank
1's next all_reduce matches it. Before Note [A timed-out group], rank 0's next all_reduce went on
and the ranks mixed the data of different calls; now the group refuses it with
GroupUnusableError (uncaught here, so the abort hook ends the job at once).
"""

import sys
import time

import numpy as np

import hpcgrad.distributed as dist


def say(rank, text):
    sys.stdout.write(f"[rank {rank}] {text.replace(chr(10), ' | ')}\n")
    sys.stdout.flush()


def main():
    dist.init_process_group(timeout=1)
    rank = dist.get_rank()
    if rank == 0:
        try:
            dist.all_reduce(np.array([1000.0]), async_op=True).wait()
        except dist.CommTimeoutError as error:
            say(rank, f"caught CommTimeoutError: {error}")
    else:
        time.sleep(2.5)  # skips the first all_reduce, and waits until rank 0 has timed out
    y = np.array([100.0 if rank == 0 else 10.0])
    try:
        dist.all_reduce(y)
    except Exception as error:
        say(rank, f"{type(error).__name__}: {error}")
        raise
    say(rank, f"all_reduce gives {y.tolist()}")
    dist.barrier()


if __name__ == "__main__":
    main()
