"""DDP across simulated nodes: step, compute and communication times, and their overlap, with the progress thread and hierarchical all-reduce on and off.

As root, this script builds a cluster per layout (``tests/cluster/cluster.py``: node i is a
network namespace with its own hostname; a ``tc tbf`` on each node's link shapes the traffic
into it; MPICH moves inter-node data over ofi/tcp), runs itself under mpiexec across the nodes
(``--worker``), tears the cluster down and prints a table per layout:

    python benchmarks/ddp_cluster.py --nice -20                  # 2x1 and 2x2 at 1gbit, ~2 min
    python benchmarks/ddp_cluster.py --layouts 2x1 --rate 500mbit --models mlp --json out.json

A layout NxR is N nodes of R ranks. Per model and configuration (progress thread off/on,
and with R > 1 the hierarchical all-reduce off/on), the worker times, as the slowest rank's
time, medians of at least ``--repeats`` repetitions (rounded up to whole turns: in each the
configurations' quantities all run once, a different one first each time and the rest in a
shuffled order, the same on every rank, so the machine's load and any drift within a
repetition fall on all alike):

  compute  a DDP step (forward, cross-entropy, zero_grad, backward, SGD step) under no_sync():
           the same work without any communication
  comm     the all-reduce of the same buckets alone (each bucket's array, in DDP's bucket
           order, started back to back on DDP's own group, then waited for)
  pause    the same all-reduces launched, then a sleep of --pause-ms without MPI calls, then
           waited for: comm - (pause - sleep) is the part that went on without anyone
           inside MPI (no thread: what the socket buffers take at launch)
  step     the DDP step
  ratio    = step / max(compute, comm): 1 when the shorter is hidden entirely behind the longer
  overlap  = (compute + comm - step) / min(compute, comm): the share of the shorter hidden
           (1: all of it; 0: none, step = compute + comm). benchmarks/ddp.py divides by comm.

Beside them, from the steps themselves: when each bucket's all-reduce was launched and
completed (by the progress thread, or by finalize's wait), when backward's last gradient came
(finalize starts), and the "bound": the step had each all-reduce run alone on the link from its
launch (at the comm-alone rate), followed by the step's own tail (the optimizer step): what
no way of driving MPI can beat (but for the noise of the comm-alone rate), since a bucket
cannot leave before its gradients exist.
Each row also has "split": forward (with the loss), zero_grad, backward and optimizer step
of the compute-only steps, the scaling model's inputs (``benchmarks/scaling.py
--ddp-cluster``). With the thread on, ``ProgressThread.stats()`` per step: polls, the thread's CPU time and how
late its sleeps ran (waiting for a core or the GIL). The JSON (``--json``) has every run's
times, the minima, the timelines and DDP's own logging data (_get_ddp_logging_data).

The machine has 2 cores: 2x1 gives each rank a core of its own; 2x2 is oversubscribed (4 ranks
on 2 cores), which its table's header says. On a shared machine ``--nice -20`` (root) puts the
ranks ahead of other load (the header gives the load average). See Note [Progress across
nodes] in hpcgrad/comm/progress.py for what the figures showed.
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_name] = "1"

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (input shape without batch, batch per rank, layer specs as in benchmarks/training.py)
MODELS = {
    "mlp": ((784,), 256, [("linear", 784, 1024), ("relu",), ("linear", 1024, 1024), ("relu",),
                          ("linear", 1024, 10)]),
    "cnn": ((1, 28, 28), 64, [("conv", 1, 8), ("relu",), ("pool",), ("conv", 8, 16), ("relu",),
                              ("pool",), ("flatten",), ("linear", 16 * 7 * 7, 10)]),
    # The CNN's gradient is 37 KB: no communication to speak of. This one has the CNN's
    # convolutions and a few MB of gradient, most of it in its first linear layer.
    "cnn-wide": ((1, 28, 28), 64, [("conv", 1, 16), ("relu",), ("pool",), ("conv", 16, 32),
                                   ("relu",), ("pool",), ("flatten",),
                                   ("linear", 32 * 7 * 7, 512), ("relu",), ("linear", 512, 10)]),
}
TITLES = {"mlp": "MLP 784-1024-1024-10", "cnn": "CNN conv8-pool-conv16-pool-fc",
          "cnn-wide": "CNN conv16-pool-conv32-pool-fc512-fc"}


# --- worker: runs on every rank under mpiexec ---------------------------------------------------
def build(specs):
    from hpcgrad import nn
    make = {"linear": lambda a, b: nn.Linear(a, b), "relu": nn.ReLU,
            "conv": lambda a, b: nn.Conv2d(a, b, 3, padding=1), "pool": lambda: nn.MaxPool2d(2),
            "flatten": nn.Flatten}
    return nn.Sequential(*[make[s[0]](*s[1:]) for s in specs])


class Case:
    """One DDP model under one configuration, with the three things to time."""

    def __init__(self, name, hierarchical, world):
        import hpcgrad as hg
        import hpcgrad.nn.functional as F
        from hpcgrad.nn.parallel import DistributedDataParallel

        shape, batch, specs = MODELS[name]
        os.environ["HPCGRAD_HIERARCHICAL_ALLREDUCE"] = hierarchical  # read by DDP's own group
        hg.manual_seed(0)
        self.ddp = DistributedDataParallel(build(specs), bucket_cap_mb=ARGS.bucket_cap_mb)
        rng = np.random.default_rng(world.Get_rank())
        x = hg.tensor(rng.standard_normal((batch,) + shape).astype(np.float32))
        y = hg.tensor(rng.integers(0, 10, batch))
        optimizer = hg.optim.SGD(self.ddp.parameters(), lr=0.01, momentum=0.9)

        def step():
            t0 = time.perf_counter()
            loss = F.cross_entropy(self.ddp(x), y)
            t1 = time.perf_counter()
            optimizer.zero_grad()
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            optimizer.step()
            # forward (with the loss), zero_grad, backward, optimizer step: the scaling
            # model's inputs (benchmarks/scaling.py --ddp-cluster)
            self.parts = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        self.step = step
        self.marks, self.splits = [], []

    def compute(self):
        with self.ddp.no_sync():
            self.step()
        self.splits.append(self.parts)

    def traced_step(self):
        """A DDP step that records, from its start: each bucket's launch and completion (the
        progress thread, or the wait in finalize, completes it) and finalize's start."""
        reducer = self.ddp.reducer
        group, finalize = reducer.process_group, reducer.finalize_backward
        marks = {"launch": [], "done": [], "bytes": []}
        t0 = time.perf_counter()

        def iallreduce(array, *args, **kwargs):
            marks["launch"].append(time.perf_counter() - t0)
            marks["bytes"].append(int(array.nbytes))
            work = type(group).iallreduce(group, array, *args, **kwargs)
            index = len(marks["done"])
            marks["done"].append(None)
            work.get_future().add_done_callback(
                lambda _: marks["done"].__setitem__(index, time.perf_counter() - t0))
            return work

        def finalize_backward():
            marks["finalize"] = time.perf_counter() - t0
            finalize()
            marks["written"] = time.perf_counter() - t0

        group.iallreduce, reducer.finalize_backward = iallreduce, finalize_backward
        try:
            self.step()
        finally:
            del group.iallreduce, reducer.finalize_backward
        marks["end"] = time.perf_counter() - t0
        marks["forward"] = self.parts[0] + self.parts[1]  # backward starts here
        self.marks.append(marks)

    def comm(self):
        group = self.ddp.reducer.process_group
        works = [group.iallreduce(array) for array in self.arrays]
        for work in works:
            work.wait()

    def pause(self):
        """The buckets' all-reduces launched, ``--pause-ms`` without MPI calls (a sleep), then
        waited for: what goes on without anyone inside MPI (with the thread off, the socket
        buffers' worth) shows as comm - (this - pause)."""
        group = self.ddp.reducer.process_group
        works = [group.iallreduce(array) for array in self.arrays]
        time.sleep(ARGS.pause_ms * 1e-3)
        for work in works:
            work.wait()

    def prepare_comm(self):
        """After the buckets are rebuilt (the first synced steps): arrays like them."""
        self.arrays = [np.zeros_like(b.contents) for b in self.ddp.reducer.buckets]
        self.marks, self.splits = [], []


def worker(args):
    sys.path.insert(0, ROOT)
    import hpcgrad.distributed as dist
    from hpcgrad.comm.mpi import MPI

    if args.nice:
        os.nice(args.nice)  # negative (root only): the ranks before the machine's other load
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    dist.init_process_group(timeout=600)
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = local.Get_size()
    local.Free()
    hier_modes = ["0", "1"] if per_node > 1 and not args.no_hier else ["0"]
    progress_modes = [p for p in ("off", "on") if p in args.progress]
    results = []
    for name in args.models:
        cases = {(p, h): Case(name, h, world) for h in hier_modes for p in progress_modes}
        bucket_bytes = None
        for (p, _), case in cases.items():  # compile kernels, rebuild buckets
            _progress(p)
            for _ in range(args.warmup):
                case.step()
                case.compute()
            case.prepare_comm()
            bucket_bytes = [int(a.nbytes) for a in case.arrays]
        _progress("off")
        times = {(key, what): [] for key in cases for what in WHATS}
        thread_stats = {}
        before = {key: case.ddp._get_ddp_logging_data() for key, case in cases.items()}
        order = [(key, what) for key in cases for what in WHATS]
        # Whole turns, so every quantity goes first as often (a step ran 60 ms slower in the
        # last position of four than in the first, whatever ran)
        turns = -(-args.repeats // len(order)) * len(order)
        reps, deadline = 0, time.monotonic() + args.budget / len(args.models)
        for rep in range(turns):
            # Each quantity goes first equally often; the rest in an order drawn per repetition
            # (the same on every rank), so no quantity always follows the same one.
            k = rep % len(order)
            first, rest = order[k], order[:k] + order[k + 1:]
            random.Random(rep).shuffle(rest)
            for key, what in [first, *rest]:
                case = cases[key]
                _progress(key[0])
                world.Barrier()
                t0 = time.perf_counter()
                getattr(case, "traced_step" if what == "step" else what)()
                elapsed = time.perf_counter() - t0
                if key[0] == "on":
                    thread_stats.setdefault((key, what), []).append(progress_stats())
                _progress("off")
                times[key, what].append(world.allreduce(elapsed, op=MPI.MAX))
            reps += 1
            late = time.monotonic() > deadline and reps % len(order) == 0
            if world.bcast(late if rank == 0 else None, root=0):
                break  # every rank stops at the same repetition: rank 0's clock decides
        for key, case in cases.items():
            after = case.ddp._get_ddp_logging_data()
            row = {"model": name, "progress": key[0], "hierarchical": key[1], "repeats": reps,
                   "bucket_bytes": bucket_bytes}
            for what in WHATS:
                row[what] = statistics.median(times[key, what])
                row[what + "_min"] = min(times[key, what])
                row[what + "_runs"] = times[key, what]
            row["logged"] = _logged_ms(before[key], after, world)
            row["timeline"] = _timeline(case.marks, world)
            row["split"] = _split(case.splits, world)
            row["thread"] = {what: {k: world.allreduce(statistics.median(
                s[k] for s in thread_stats[key, what]), op=MPI.MAX)
                for k in ("polls", "cpu", "late")}
                for what in WHATS if (key, what) in thread_stats}
            results.append(row)
        for case in cases.values():
            case.ddp.reducer.remove_hooks()
    _progress("off")
    layout = world.gather(MPI.Get_processor_name(), root=0)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": size, "ranks_per_node": per_node, "hosts": layout,
                       "rows": results}, f)


def _timeline(marks, world):
    """Medians over the timed steps of the slowest rank's bucket launches and completions,
    finalize's start and end, and the step's end (ms from the step's start)."""
    from hpcgrad.comm.mpi import MPI
    rows = np.array([m["launch"] + m["done"] + [m["finalize"], m["written"], m["end"],
                                                 m["forward"]]
                     for m in marks], dtype=np.float64) * 1e3
    slowest = np.empty_like(rows)
    world.Allreduce(rows, slowest, op=MPI.MAX)
    med = np.median(slowest, axis=0).tolist()
    n = len(marks[0]["launch"])
    # every rank's marks of every step, for a look at how the ranks differ
    ranks = world.gather(rows.round(3).tolist(), root=0)
    return {"launch": med[:n], "done": med[n:2 * n], "finalize": med[2 * n],
            "written": med[2 * n + 1], "end": med[2 * n + 2], "forward": med[2 * n + 3],
            "bytes": marks[0]["bytes"], "ranks": ranks}


def _split(splits, world):
    """Medians over the compute-only steps of the slowest rank's forward (with the loss),
    zero_grad, backward and optimizer step, seconds."""
    from hpcgrad.comm.mpi import MPI
    rows = np.array(splits, dtype=np.float64)
    slowest = np.empty_like(rows)
    world.Allreduce(rows, slowest, op=MPI.MAX)
    med = np.median(slowest, axis=0).tolist()
    return dict(zip(("forward", "zero_grad", "backward", "optimizer"), med))


def progress_stats():
    from hpcgrad.comm import progress
    return progress.progress_thread().stats()


def _progress(mode):
    from hpcgrad.comm import progress
    if mode == "on":
        progress.start_progress_thread(ARGS.interval * 1e-6 if ARGS.interval else None)
    else:
        progress.stop_progress_thread()


def _logged_ms(before, after, world):
    """The timed steps' averages of DDP's own timing (Note [DDP logging data]), ms, rank max."""
    steps = after["iteration"] - before["iteration"]
    out = {}
    for key in ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
                "avg_backward_compute_comm_overlap_time"):
        total = (after[key] * (after["iteration"] - 1) - before[key] * (before["iteration"] - 1))
        mine = total / max(steps, 1) / 1e6
        out[key[4:-5]] = world.allreduce(mine, op=_max())
    return out


def _max():
    from hpcgrad.comm.mpi import MPI
    return MPI.MAX


# --- driver: builds each cluster and runs the worker across it ----------------------------------
def run_layout(nodes, per_node, args):
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
    from cluster import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--budget", str(args.budget), "--models", *args.models,
               "--progress", *args.progress, "--bucket-cap-mb", str(args.bucket_cap_mb),
               "--interval", str(args.interval or 0), "--nice", str(args.nice),
               "--pause-ms", str(args.pause_ms)]
        cmd += ["--no-hier"] if args.no_hier else []
        with Cluster(nodes, rate=args.rate) as cluster:
            timeout = int(args.budget * 2 + 120)
            env = {**os.environ, **cluster.mpi_env(), "MPIEXEC_TIMEOUT": str(timeout)}
            # The worker switches both itself (DDP would start the thread across nodes)
            env.update(HPCGRAD_HIERARCHICAL_ALLREDUCE="0", HPCGRAD_PROGRESS_THREAD="0")
            proc = subprocess.run(cluster.mpiexec_argv(nodes * per_node, cmd), env=env, check=False,
                                  timeout=timeout + 10, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{nodes}x{per_node} at {args.rate}: mpiexec exited "
                               f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def ratio(row):
    return row["step"] / max(row["compute"], row["comm"])


def overlap(row):
    return (row["compute"] + row["comm"] - row["step"]) / min(row["compute"], row["comm"])


def ahead(row):
    """Seconds of the all-reduces that went on during the pause without MPI calls."""
    return row["comm"] - (row["pause"] - ARGS.pause_ms * 1e-3)


def bound(row):
    """The step's lower bound given when its buckets were launched: the all-reduces one after
    the other on the link from their launch, each at the comm-alone rate, then what follows
    the write-back (the optimizer step); never below compute."""
    tl = row["timeline"]
    per_byte = row["comm"] / sum(tl["bytes"])
    t = 0.0
    for launch, nbytes in zip(tl["launch"], tl["bytes"]):
        t = max(t, launch / 1e3) + nbytes * per_byte
    return max(row["compute"], t + (tl["end"] - tl["written"]) / 1e3)


def print_table(result, rate, nodes):
    p, per_node = result["ranks"], result["ranks_per_node"]
    note = f"oversubscribed: {p} ranks on 2 cores" if p > 2 else "a core per rank"
    nice = f", ranks at nice {result['nice']}" if result["nice"] else ""
    print(f"{nodes} nodes x {per_node} rank(s), link {rate or 'unshaped'} per node ({note}); "
          f"medians of {result['rows'][0]['repeats']}, slowest rank, ms (load average "
          f"{result['load']:.1f}{nice})")
    head = (f"{'model':9} {'progress':>8} {'hier':>4} {'compute':>8} {'comm':>7} {'step':>7} "
            f"{'step/max':>8} {'overlap':>7} {'ahead':>5} | {'launches':>12} {'bwd end':>7} "
            f"{'done':>12} {'bound':>6} {'step/bound':>10}")
    print(head)
    print("-" * len(head))
    for row in result["rows"]:
        tl = row["timeline"]
        launches = ",".join(f"{t:.0f}" for t in tl["launch"])
        done = ",".join(f"{t:.0f}" for t in tl["done"])
        print(f"{row['model']:9} {row['progress']:>8} {row['hierarchical']:>4} "
              f"{row['compute'] * 1e3:8.1f} {row['comm'] * 1e3:7.1f} {row['step'] * 1e3:7.1f} "
              f"{ratio(row):7.2f}x {overlap(row):7.0%} {ahead(row) * 1e3:5.1f} | {launches:>12} {tl['finalize']:7.0f} "
              f"{done:>12} {bound(row) * 1e3:6.1f} {row['step'] / bound(row):9.2f}x")
    for row in result["rows"]:
        for what, st in row.get("thread", {}).items():
            if what != "compute":
                print(f"  progress thread, {row['model']} hier {row['hierarchical']} {what}: "
                      f"{st['polls']:.0f} polls, {st['cpu'] * 1e3:.1f} ms CPU, sleeps "
                      f"{st['late'] * 1e3:.1f} ms late in all (per step, slowest rank)")
    sizes = {row["model"]: row["bucket_bytes"] for row in result["rows"]}
    print("buckets in launch order: " + "; ".join(
        f"{m} {', '.join(f'{b / 1e6:.2f}' for b in s)} MB" for m, s in sizes.items()))
    print("ahead: ms of the all-reduces done during a sleep without MPI calls (comm - (pause "
          "- sleep))")
    print("launches, done: each bucket's all-reduce launched and completed, bwd end: backward's "
          "last gradient (finalize starts), ms into the step; bound: the step if each all-reduce "
          "ran alone on the link from its launch")
    print()


def parse_layout(text):
    try:
        nodes, per_node = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is NODESxRANKS_PER_NODE, e.g. 2x1, got "
                                         f"{text!r}") from None
    return nodes, per_node


ARGS = None
WHATS = ("compute", "comm", "pause", "step")


def main(argv=None):
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=[(2, 1), (2, 2)],
                   metavar="NxR", help="nodes x ranks per node (default 2x1 2x2)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each node's link "
                   "(default 1gbit; 'none': unshaped)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "cnn",
                                                                           "cnn-wide"])
    p.add_argument("--progress", nargs="+", choices=("off", "on"), default=["off", "on"],
                   help="progress thread settings to measure")
    p.add_argument("--no-hier", action="store_true", help="leave out the hierarchical runs")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--interval", type=float, default=0, help="progress thread interval, us "
                   "(default: the thread's own)")
    p.add_argument("--nice", type=int, default=0, help="niceness increment of the ranks; "
                   "negative (as root) puts them ahead of other load on a shared machine")
    p.add_argument("--pause-ms", type=float, default=40.0, help="the sleep of the 'pause' "
                   "quantity (default 40)")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=100.0, help="seconds of timed repetitions "
                   "per layout, shared by the models: past it a model stops at the end of a "
                   "whole turn (the table says how many repetitions ran)")
    p.add_argument("--json", metavar="FILE", help="write every layout's results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = ARGS = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.rate = None if args.rate == "none" else args.rate
    results = []
    for nodes, per_node in args.layouts:
        result = run_layout(nodes, per_node, args)
        result.update(rate=args.rate, nodes=nodes, nice=args.nice, pause_ms=args.pause_ms,
                      load=os.getloadavg()[0])
        results.append(result)
        print_table(result, args.rate, nodes)
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                time.gmtime()),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
