"""Prints torchrun's variables as a script written for torchrun reads them under mpiexec,
before and after init_process_group (Note [torchrun's variables])."""

import os
import sys

import hpcgrad.distributed as dist

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
before = [os.environ.get(n) for n in NAMES]
dist.init_process_group()
after = [os.environ.get(n) for n in NAMES]
sys.stdout.write(f"[rank {dist.get_rank()}] before {before} after {after} local "
                 f"{dist.get_local_rank()} {dist.get_local_size()}\n")  # one write: one line
sys.stdout.flush()
