"""Does a nonblocking all_reduce progress while Python computes? Four ways, measured on 2 ranks.

Each rank starts ``hpcgrad.distributed.all_reduce(buf, async_op=True)`` on a float32 buffer, then
computes (chunks of a float64 matmul, which releases the GIL) for about as long as the
all_reduce takes alone, then waits. Strategies:

  none      nothing between compute chunks (MPI is only entered at the final wait)
  poll      ``work.is_completed()`` after every compute chunk (what autograd hooks could do)
  async     no polling, but MPICH's own progress thread (MPIR_CVAR_ASYNC_PROGRESS=1, set in the
            environment of a second mpiexec job, since MPI reads it at MPI_Init)
  thread    hpcgrad's progress thread (hpcgrad.distributed.start_progress_thread): tests the
            pending Work every ``--interval`` us (``Work.is_completed``, thread-safe) until done
  probe     the prototype of an alternative: a thread that only pokes MPI's progress engine
            (``Iprobe`` on a private communicator) instead of testing the request

Per size and strategy, medians over ``--repeats`` runs of:
  compute   the compute chunks alone (the async job measures them with MPICH's thread running)
  comm      the all_reduce alone (start, then wait)
  total     start, compute, wait
  overlap = (compute + comm - total) / comm: 1 when the all_reduce is hidden entirely, 0 when
            it only runs at the final wait.

Usage (no mpiexec: the script launches its two 2-rank jobs itself):
    /work/venv/bin/python benchmarks/progress.py
    /work/venv/bin/python benchmarks/progress.py --quick
One job by hand:  mpiexec -n 2 python benchmarks/progress.py --worker --strategies none,poll
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # one core per rank for compute, as on a node with a rank per core

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

MB = 1 << 20
CHUNK = 256  # matmul side: one chunk is about a millisecond here
SLEEP_CHUNK = 1e-3


def compute_chunk(kind, a, b):
    if kind == "matmul":
        return a @ b
    time.sleep(SLEEP_CHUNK)  # the core is idle: a GPU kernel, or reading the next batch


class ProbeThread:
    """Prototype: while a watched Work is pending, Iprobe a private communicator every
    ``interval`` seconds (progress for everything, without touching the request)."""

    def __init__(self, interval):
        import threading
        from hpcgrad.comm.mpi import MPI
        self.interval = interval
        self.comm = MPI.COMM_WORLD.Dup()
        self.pending = []
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def watch(self, work):
        self.pending.append(work)
        self.wake.set()
        return work

    def run(self):
        from hpcgrad.comm.mpi import MPI
        while not self.stopped:
            if not self.pending:
                self.wake.wait()
                self.wake.clear()
                continue
            self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            self.pending = [w for w in self.pending if not w._completed]
            time.sleep(self.interval)

    def stop(self):
        self.stopped = True
        self.wake.set()
        self.thread.join()
        self.comm.Free()


def worker(args):
    import hpcgrad.distributed as dist
    from hpcgrad.comm.mpi import MPI

    dist.init_process_group()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((CHUNK, CHUNK)), rng.standard_normal((CHUNK, CHUNK))
    strategies = args.strategies.split(",")
    results = []
    for kind, size in [(k, s) for k in args.compute.split(",") for s in args.sizes]:
        buf = np.zeros(size * MB // 4, np.float32)

        def comm_alone():
            dist.all_reduce(buf, async_op=True).wait()

        def run_chunks(n, between=None):
            for _ in range(n):
                compute_chunk(kind, a, b)
                if between is not None:
                    between()

        # Calibrate: as many chunks as the all_reduce takes alone (agreed across ranks).
        for _ in range(2):
            comm_alone()
        t_comm = timed(comm, comm_alone, 3)
        t_chunk = timed(comm, lambda: run_chunks(10), 3) / 10
        chunks = int(comm.allreduce(max(4, round(t_comm / t_chunk)), op=MPI.MAX))

        for strategy in strategies:
            prober = ProbeThread(args.interval * 1e-6) if strategy == "probe" else None
            if strategy == "thread":  # watches every operation of >= 64 KB from now on
                dist.start_progress_thread(interval=args.interval * 1e-6)

            def total():
                work = dist.all_reduce(buf, async_op=True)
                if prober is not None:
                    prober.watch(work)
                run_chunks(chunks, work.is_completed if strategy == "poll" else None)
                work.wait()

            try:
                times = {"compute": [], "comm": [], "total": []}
                for _ in range(args.repeats):  # interleaved, so drift hits all three alike
                    times["compute"].append(timed(comm, lambda: run_chunks(chunks), 1))
                    times["comm"].append(timed(comm, comm_alone, 1))
                    times["total"].append(timed(comm, total, 1))
            finally:
                if prober is not None:
                    prober.stop()
                dist.stop_progress_thread()
            med = {k: statistics.median(v) for k, v in times.items()}
            med["overlap"] = (med["compute"] + med["comm"] - med["total"]) / med["comm"]
            results.append({"compute_kind": kind, "size_mb": size,
                            "strategy": args.label or strategy,
                            "chunks": chunks, **med})
    if comm.Get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)


def timed(comm, fn, repeats):
    """Median seconds of fn() over repeats, each started together and ended by the slowest rank."""
    from hpcgrad.comm.mpi import MPI
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def launch(args, strategies, env_extra, label=None):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", sys.executable, __file__,
           "--worker", "--strategies", strategies, "--repeats", str(args.repeats),
           "--interval", str(args.interval), "--compute", args.compute,
           "--sizes", *map(str, args.sizes)]
    if label:
        cmd += ["--label", label]
    env = {**os.environ, "MPIEXEC_TIMEOUT": "600", **env_extra}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS "):])
    raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def print_table(rows):
    print(f"{'compute':>7} {'size':>6} {'strategy':>9} {'chunks':>7} {'compute ms':>11} "
          f"{'comm ms':>8} {'total ms':>9} {'overlap':>8}")
    key = (lambda r: (COMPUTE_ORDER.index(r["compute_kind"]), r["size_mb"],
                      STRATEGY_ORDER.index(r["strategy"])))
    for row in sorted(rows, key=key):
        print(f"{row['compute_kind']:>7} {row['size_mb']:>4}MB {row['strategy']:>9} "
              f"{row['chunks']:>7} "
              f"{row['compute'] * 1e3:11.1f} {row['comm'] * 1e3:8.1f} {row['total'] * 1e3:9.1f} "
              f"{row['overlap']:8.2f}")


STRATEGY_ORDER = ["none", "poll", "async", "thread", "probe"]
COMPUTE_ORDER = ["matmul", "sleep"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="MB (default 4 16 64)")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 7)")
    p.add_argument("--interval", type=float, default=200, help="progress thread poll interval "
                   "in us (default 200)")
    p.add_argument("--compute", default="matmul,sleep", help="what the ranks do meanwhile: "
                   "matmul (CPU-bound), sleep (the core idles, as under a GPU kernel), or both "
                   "(default matmul,sleep)")
    p.add_argument("--quick", action="store_true", help="4 and 16 MB, 3 runs")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategies", default="none,poll,thread,probe", help=argparse.SUPPRESS)
    p.add_argument("--label", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = args.sizes or ([4, 16] if args.quick else [4, 16, 64])
    args.repeats = args.repeats or (3 if args.quick else 7)
    if args.worker:
        worker(args)
        return
    rows = launch(args, "none,poll,thread,probe", {})
    rows += launch(args, "none", {"MPIR_CVAR_ASYNC_PROGRESS": "1"}, label="async")
    print(f"float32 all_reduce vs float64 {CHUNK}x{CHUNK} matmul chunks, 2 ranks, one BLAS "
          f"thread; medians of {args.repeats}; progress thread interval {args.interval:g} us")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
