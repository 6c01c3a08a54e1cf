"""What the default collective checks cost: each call with HPCGRAD_DISTRIBUTED_DEBUG=INFO
(the default; Note [Checked collectives] in hpcgrad/comm/process_group.py) beside OFF.

    mpiexec -n 2 python benchmarks/checks.py            # the figures quoted in docs/
    mpiexec -n 2 python benchmarks/checks.py --quick    # a smoke run
    python benchmarks/checks.py                         # one process: the Python cost alone

Two groups are built on the same ranks, one with the checks and one without (the level is
read when a group is made), and the two take turns within every repetition, so load from
other processes falls on both alike. Rows: a blocking float32 all_reduce of 4 B, 4 KB and
1 MB; the same 4 KB as async_op=True then wait (the check travels with the call); and a DDP
training step of an MLP (DistributedDataParallel on each group's ranks). Each figure is the
median over repetitions of the slowest rank's time per call (k back-to-back calls timed
together for small sizes); the table gives OFF, INFO and their difference.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpcgrad as hg  # noqa: E402
import hpcgrad.distributed as dist  # noqa: E402
import hpcgrad.nn as nn  # noqa: E402
import hpcgrad.nn.functional as F  # noqa: E402
from hpcgrad.comm.mpi import MPI  # noqa: E402
from hpcgrad.comm.process_group import ProcessGroup  # noqa: E402
from hpcgrad.nn.parallel import DistributedDataParallel  # noqa: E402

LEVELS = ("OFF", "INFO")


def group_with(level, world):
    """A group over ``world``'s ranks whose checks are ``level``."""
    previous = os.environ.get("HPCGRAD_DISTRIBUTED_DEBUG")
    os.environ["HPCGRAD_DISTRIBUTED_DEBUG"] = level
    try:
        return ProcessGroup(world.comm.Dup(), world.timeout, name=f"checks {level}")
    finally:
        if previous is None:
            del os.environ["HPCGRAD_DISTRIBUTED_DEBUG"]
        else:
            os.environ["HPCGRAD_DISTRIBUTED_DEBUG"] = previous


def ddp_with(level, sizes, batch):
    """A DDP step of an MLP whose private group (made at construction) has checks ``level``."""
    hg.manual_seed(0)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    previous = os.environ.get("HPCGRAD_DISTRIBUTED_DEBUG")
    os.environ["HPCGRAD_DISTRIBUTED_DEBUG"] = level
    try:
        model = DistributedDataParallel(nn.Sequential(*layers[:-1]))
    finally:
        if previous is None:
            del os.environ["HPCGRAD_DISTRIBUTED_DEBUG"]
        else:
            os.environ["HPCGRAD_DISTRIBUTED_DEBUG"] = previous
    rng = np.random.default_rng(MPI.COMM_WORLD.Get_rank())
    x = hg.tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    y = hg.tensor(rng.integers(0, sizes[-1], batch))
    params = list(model.parameters())

    def step():
        loss = F.cross_entropy(model(x), y)
        for p in params:
            p.grad = None
        loss.backward()
        for p in params:
            p.data -= 0.01 * p.grad.data
    return step, len(model.reducer.buckets)


def cases(groups, quick):
    """{row name: {level: (callable, calls per timing)}}."""
    rows = {}
    for label, nbytes in (("4 B", 4), ("4 KB", 4096), ("1 MB", 1 << 20)):
        k = 1 if nbytes >= (1 << 20) else (20 if quick else 100)
        row = {}
        for level, group in groups.items():
            buf = np.zeros(nbytes // 4, np.float32)
            row[level] = ((lambda g=group, b=buf: g.iallreduce(b, blocking=True)), k)
        rows[f"all_reduce {label}"] = row
    row = {}
    for level, group in groups.items():
        buf = np.zeros(1024, np.float32)
        row[level] = ((lambda g=group, b=buf: g.iallreduce(b).wait()), 20 if quick else 100)
    rows["all_reduce 4 KB async+wait"] = row
    sizes = [256, 512, 512, 10]
    row, buckets = {}, 0
    for level in groups:
        step, buckets = ddp_with(level, sizes, 32)
        row[level] = (step, 1)
    rows[f"DDP step, MLP {'-'.join(map(str, sizes))} ({buckets} buckets)"] = row
    return rows


def measure(rows, repeats, warmup=3):
    comm = MPI.COMM_WORLD
    times = {name: {level: [] for level in row} for name, row in rows.items()}
    for i in range(warmup + repeats):
        for name, row in rows.items():
            order = list(row) if i % 2 else list(row)[::-1]  # each level goes first as often
            for level in order:
                run, k = row[level]
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(k):
                    run()
                elapsed = (time.perf_counter() - start) / k
                slowest = comm.allreduce(elapsed, op=MPI.MAX)
                if i >= warmup:
                    times[name][level].append(slowest)
    return {name: {level: statistics.median(t) for level, t in row.items()}
            for name, row in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 41; "
                   "--quick: 5)")
    p.add_argument("--quick", action="store_true", help="a smoke run")
    args = p.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 41)
    world = dist.init_process_group()
    groups = {level: group_with(level, world) for level in LEVELS}
    rows = cases(groups, args.quick)
    med = measure(rows, repeats)
    if MPI.COMM_WORLD.Get_rank() == 0:
        library = MPI.Get_library_version().splitlines()[0]
        print(f"collective checks (HPCGRAD_DISTRIBUTED_DEBUG), {world.size()} rank(s), "
              f"{library}; medians of {repeats} repetitions, the slowest rank's time per call")
        print(f"{'call':<40} {'OFF':>10} {'INFO':>10} {'INFO - OFF':>11} {'ratio':>6}")
        for name, row in med.items():
            off, info = row["OFF"], row["INFO"]
            print(f"{name:<40} {off * 1e6:8.1f}us {info * 1e6:8.1f}us "
                  f"{(info - off) * 1e6:+9.1f}us {info / off:6.2f}")
    for group in groups.values():
        group.free()


if __name__ == "__main__":
    main()
