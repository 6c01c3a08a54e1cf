"""all_reduce bus bandwidth: hpcgrad.distributed against raw mpi4py (and torch gloo with --torch).

Every rank reduces one float32 buffer (zeros, so sums never overflow or go denormal) in place,
through ``hpcgrad.distributed.all_reduce(buf)`` and through ``comm.Allreduce(MPI.IN_PLACE, buf)``
on the same buffer in the same run (and, to tell MPICH's nonblocking path from hpcgrad's own cost,
``comm.Iallreduce(MPI.IN_PLACE, buf).Wait()`` as "raw-i"); with ``--torch`` also
``torch.distributed.all_reduce`` (gloo) on a tensor sharing that buffer. The implementations
take turns within every repetition (the order rotates, so each runs first, on a buffer the
other sizes have evicted from the caches, equally often).

One repetition: barrier, then ``k`` back-to-back calls timed together (k > 1 for small messages,
so a latency is not one clock tick); time per call = elapsed / k, the largest over the ranks.
Figures are medians over the repetitions; each repetition sweeps every size, so load from other
processes spreads over all rows.

    bus bandwidth = 2 (n - 1) / n * bytes / time    (n ranks; what a ring allreduce moves per link)

Usage (2 ranks; the figures quoted in docs/ come from this line):
    /work/venv/bin/mpiexec -n 2 /work/venv/bin/python benchmarks/comm.py
    /work/venv/bin/mpiexec -n 2 /work/venv/bin/python benchmarks/comm.py --torch   # + gloo
    /work/venv/bin/mpiexec -n 2 /work/venv/bin/python benchmarks/comm.py --quick   # smoke run

Per-call overhead alone: ``python benchmarks/comm.py --overhead`` times a 4 KB all_reduce against
``comm.Allreduce`` in a loop (hot caches) and with a 4 MB array rewritten before every call (cold
caches, as after a large transfer or a layer's compute); in one process (no peer), or under
``mpiexec -n 2`` (medians of the slower rank's times). ``--debug INFO`` (or DETAIL) times it with
HPCGRAD_DISTRIBUTED_DEBUG's call checks on (hpcgrad/comm/debug.py).

Targets (issue 5): hpcgrad >= 95% of raw mpi4py's bandwidth at 1 MB and above; added latency
under 20 us for small messages.
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # nothing here computes; keep BLAS pools from competing with MPI

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpcgrad.distributed as dist  # noqa: E402
from hpcgrad.comm.mpi import MPI  # noqa: E402

KB, MB = 1 << 10, 1 << 20
SMALL = 64 * KB  # up to here the table's headline is latency, above it bandwidth


def sizes(quick):
    top = 4 * MB if quick else 64 * MB
    out, n = [], 4 * KB
    while n <= top:
        out.append(n)
        n *= 4
    return out


def calls_per_repetition(nbytes):
    """Enough back-to-back calls that one repetition lasts ~1 ms or more (1 for large buffers)."""
    return max(1, min(200, (256 * KB) // nbytes))


def setup_torch(comm):
    """torch.distributed with gloo over the MPI ranks (rank 0 picks a free port); None if absent."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    torch.set_num_threads(1)
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                             rank=comm.Get_rank(), world_size=comm.Get_size())
    return torch, tdist


def implementations(buf, comm, torch_mods):
    impls = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, buf),
             "raw-i": lambda: comm.Iallreduce(MPI.IN_PLACE, buf).Wait(),
             "hpcgrad": lambda: dist.all_reduce(buf)}
    if torch_mods is not None:
        torch, tdist = torch_mods
        tensor = torch.from_numpy(buf)  # shares buf's memory
        impls["gloo"] = lambda: tdist.all_reduce(tensor)
    return impls


def measure(all_sizes, comm, torch_mods, repeats, warmup):
    """[{"bytes": n, "seconds": {impl: median seconds per call}}] for every size.

    Repetitions are the outer loop and sizes the inner one, so a burst of load from other
    processes (this machine is shared) lands on every size alike instead of on one row.
    """
    cases = []
    for nbytes in all_sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        cases.append((nbytes, implementations(buf, comm, torch_mods), buf))
    times = {(nbytes, name): [] for nbytes, impls, _ in cases for name in impls}
    for rep in range(warmup + repeats):
        for nbytes, impls, _ in cases:
            names = list(impls)
            names = names[rep % len(names):] + names[:rep % len(names)]  # each goes first in turn
            k = calls_per_repetition(nbytes)
            for name in names:
                run = impls[name]
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    run()
                elapsed = (time.perf_counter() - t0) / k
                if rep >= warmup:
                    times[nbytes, name].append(elapsed)
    rows = []
    for nbytes, impls, _ in cases:
        row = {"bytes": nbytes, "seconds": {}}
        for name in impls:
            # A collective ends when its slowest rank is done: each repetition's maximum.
            mine = np.array(times[nbytes, name])
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, op=MPI.MAX)
            row["seconds"][name] = statistics.median(slowest.tolist())
        rows.append(row)
    return rows


def busbw(nbytes, seconds, nranks):
    return 2 * (nranks - 1) / nranks * nbytes / seconds / 1e9


def human(nbytes):
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def print_table(rows, nranks, with_torch):
    head = (f"{'size':>7} {'raw us':>9} {'raw-i us':>9} {'hpcgrad us':>11} {'+us':>6} "
            f"{'raw GB/s':>9} {'hpcgrad GB/s':>13} {'hpcgrad/raw':>12}")
    if with_torch:
        head += f" {'gloo us':>9} {'gloo GB/s':>10} {'gloo/raw':>9}"
    print(head)
    print("-" * len(head))
    for row in rows:
        n, t = row["bytes"], row["seconds"]
        raw, hpc = t["raw"], t["hpcgrad"]
        line = (f"{human(n):>7} {raw * 1e6:9.1f} {t['raw-i'] * 1e6:9.1f} {hpc * 1e6:11.1f} "
                f"{(hpc - raw) * 1e6:6.1f} "
                f"{busbw(n, raw, nranks):9.3f} {busbw(n, hpc, nranks):13.3f} {raw / hpc:12.2f}")
        if with_torch:
            gloo = t["gloo"]
            line += f" {gloo * 1e6:9.1f} {busbw(n, gloo, nranks):10.3f} {raw / gloo:9.2f}"
        print(line)


def verdict(rows):
    big = [row["seconds"]["raw"] / row["seconds"]["hpcgrad"] for row in rows if row["bytes"] >= MB]
    small = [(row["seconds"]["hpcgrad"] - row["seconds"]["raw"]) * 1e6 for row in rows
             if row["bytes"] <= SMALL]
    lines = []
    if big:
        lines.append(f"hpcgrad/raw at >= 1 MB: min {min(big):.3f} (target >= 0.95: "
                     f"{'met' if min(big) >= 0.95 else 'MISSED'})")
    if small:
        lines.append(f"added latency at <= 64 KB: max {max(small):.1f} us (target < 20 us: "
                     f"{'met' if max(small) < 20 else 'MISSED'})")
    return lines


def overhead(repeats):
    """Median extra microseconds of dist.all_reduce over comm.Allreduce, hot and cold."""
    comm = dist.init_process_group().comm
    buf = np.zeros(1024, np.float32)
    junk = np.zeros(1 << 20, np.float32)
    impls = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, buf),
             "hpcgrad": lambda: dist.all_reduce(buf)}
    out = {}
    for case in ("hot", "cold"):
        times = {name: [] for name in impls}
        for _ in range(repeats):
            for name, run in impls.items():
                comm.Barrier()  # at 2 ranks, both start together: no wait for the peer counted
                if case == "cold":
                    junk += 1  # evicts the interpreter's working set from L1/L2
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        med = {}
        for name, t in times.items():
            mine = np.array(t)
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, op=MPI.MAX)  # a call ends when its slowest rank is done
            med[name] = statistics.median(slowest.tolist())
        out[case] = med
        if comm.Get_rank() == 0:
            print(f"{case:>4}: comm.Allreduce {med['raw'] * 1e6:6.2f} us, hpcgrad all_reduce "
                  f"{med['hpcgrad'] * 1e6:6.2f} us: +{(med['hpcgrad'] - med['raw']) * 1e6:.2f} "
                  "us per call")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per size "
                   "(default 21; --quick: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--quick", action="store_true", help="4 KB to 4 MB, 5 repetitions")
    p.add_argument("--torch", action="store_true", help="also torch.distributed gloo (skipped, "
                   "with a note, when torch is not installed)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--overhead", action="store_true", help="hpcgrad's per-call cost over "
                   "comm.Allreduce, hot and cold caches (5000 calls each)")
    p.add_argument("--debug", choices=["OFF", "INFO", "DETAIL"], help="set "
                   "HPCGRAD_DISTRIBUTED_DEBUG (the per-call checks) for this run")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.debug:
        os.environ["HPCGRAD_DISTRIBUTED_DEBUG"] = args.debug  # read when the group is made
    if args.overhead:
        overhead(args.repeats or 5000)
        return
    repeats = args.repeats or (5 if args.quick else 21)
    dist.init_process_group()
    comm = MPI.COMM_WORLD.Dup()  # raw traffic on its own communicator, as hpcgrad's group has
    rank, nranks = comm.Get_rank(), comm.Get_size()
    torch_mods = setup_torch(comm) if args.torch else None
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0]
        print(f"all_reduce float32 in place, {nranks} ranks, {library}; medians of {repeats} "
              "repetitions")
        if args.torch and torch_mods is None:
            print("(--torch: torch is not installed; gloo left out)")
    rows = measure(sizes(args.quick), comm, torch_mods, repeats, args.warmup)
    if rank == 0:
        print_table(rows, nranks, torch_mods is not None)
        for line in verdict(rows):
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": nranks, "repeats": repeats, "rows": rows}, f, indent=2)
    if torch_mods is not None:
        torch_mods[1].destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
