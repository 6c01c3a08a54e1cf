"""Flat vs hierarchical all_reduce on simulated nodes (network namespaces, tc-shaped links): medians, bus bandwidth, JSON.

As root, this script builds each cluster (``tests/cluster/cluster.py``: node i is a network
namespace with its own hostname; a ``tc tbf`` on each node's link shapes the traffic into it),
runs itself under mpiexec across the nodes (``--worker``), tears the cluster down, and prints:

    python benchmarks/cluster_allreduce.py            # 2 and 4 nodes, 2 ranks each, 1gbit (~2 min)
    python benchmarks/cluster_allreduce.py --layouts 1x2 2x1 2x2 4x2 --rate 1gbit --json out.json
    python benchmarks/cluster_allreduce.py --placement cyclic     # rank r on node r % N
    python benchmarks/cluster_allreduce.py --ddp --layouts 2x2     # benchmarks/ddp.py's MLP step

Each layout takes ~30 s of timed repetitions (``--budget``) plus start-up; figures, the JSON and
what they led to: docs/scaling.md. "speed-up" is flat ms / hier ms (> 1: hierarchical faster).

A layout NxR is N nodes of R ranks. Every rank reduces one float32 buffer (zeros) in place through
hpcgrad's ProcessGroup ``iallreduce(..., blocking=True)``, with ``hierarchical='0'`` ("flat": one
MPI_Iallreduce, MPICH's own algorithm choice) and ``'1'`` ("hier": reduce in the node, all-reduce
among node leaders, broadcast in the node; Note [Hierarchical all-reduce]), and ``comm.Iallreduce``
itself ("raw", to see hpcgrad's per-call share). The three take turns within every repetition (the
order rotates); one repetition is a barrier then ``k`` back-to-back calls (k > 1 below 256 KB);
time per call = elapsed / k, the largest over the ranks; figures are medians.

    bus bandwidth = 2 (p - 1) / p * bytes / time      (p ranks)

Ranks per node share the node's link (one ``tbf`` per node), as GPUs of a node share its NIC.
MPICH's ch4 netmod is ofi/tcp between nodes and shared memory within one (Note [MPI across
namespaces] in tests/cluster/cluster.py). The machine has 2 cores: more than 2 ranks are
oversubscribed, which the table's header says.
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KB, MB = 1 << 10, 1 << 20
TABLE_SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB]
FIT_SIZES = [4 * KB, 64 * KB, 256 * KB]  # latency side, for the model's alpha
IMPLS = ("flat", "hier", "raw")


def calls_per_repetition(nbytes):
    return max(1, min(50, (256 * KB) // nbytes))


# --- worker: runs on every rank under mpiexec ---------------------------------------------------
def worker(args):
    sys.path.insert(0, ROOT)
    from hpcgrad.comm.mpi import MPI
    from hpcgrad.comm.process_group import ProcessGroup

    world = MPI.COMM_WORLD
    flat = ProcessGroup(world.Dup(), 600.0, hierarchical="0")
    hier = ProcessGroup(world.Dup(), 600.0, hierarchical="1")
    raw = world.Dup()
    rank = world.Get_rank()
    cases = []
    for nbytes in args.sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        cases.append((nbytes, {
            "flat": lambda b=buf: flat.iallreduce(b, blocking=True),
            "hier": lambda b=buf: hier.iallreduce(b, blocking=True),
            "raw": lambda b=buf: raw.Iallreduce(MPI.IN_PLACE, b).Wait()}))
    times = {(n, name): [] for n, _ in cases for name in IMPLS}
    deadline = time.monotonic() + args.budget
    for rep in range(args.warmup + args.repeats):
        for nbytes, impls in cases:
            names = IMPLS[rep % 3:] + IMPLS[:rep % 3]
            k = calls_per_repetition(nbytes)
            for name in names:
                run = impls[name]
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    run()
                if rep >= args.warmup:
                    times[nbytes, name].append((time.perf_counter() - t0) / k)
        # every rank must stop at the same repetition: rank 0's clock decides
        if world.bcast(time.monotonic() > deadline if rank == 0 else None, root=0):
            break
    rows = []
    for nbytes, _ in cases:
        row = {"bytes": nbytes, "seconds": {}, "runs": {}}
        for name in IMPLS:
            mine = np.array(times[nbytes, name])
            slowest = np.empty_like(mine)
            world.Allreduce(mine, slowest, op=MPI.MAX)
            row["seconds"][name] = statistics.median(slowest.tolist())
            row["runs"][name] = len(slowest)
        rows.append(row)
    h = hier._hier
    layout = world.gather((MPI.Get_processor_name(), h.node_index, h.local_rank), root=0)
    flat.free()
    hier.free()
    raw.Free()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": world.Get_size(), "nodes": h.nodes, "layout": layout,
                       "rows": rows, "load": os.getloadavg()}, f)


# --- driver: builds each cluster and runs the worker across it ----------------------------------
def run_layout(nodes, per_node, rate, sizes, repeats, warmup, budget, placement="block"):
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
    from cluster import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               "--repeats", str(repeats), "--warmup", str(warmup), "--budget", str(budget),
               "--sizes", *map(str, sizes)]
        with Cluster(nodes, rate=rate) as cluster:
            timeout = int(budget * 3 + 60)
            env = {**os.environ, **cluster.mpi_env(), "MPIEXEC_TIMEOUT": str(timeout)}
            env.pop("HPCGRAD_HIERARCHICAL_ALLREDUCE", None)
            if placement == "block":  # ranks 0..R-1 on node 1, R..2R-1 on node 2, ...
                argv = cluster.mpiexec_argv(nodes * per_node, cmd)
            else:  # one slot per host: hydra deals the ranks out in turn, rank r on node r % N
                argv = cluster.mpiexec_argv(nodes, cmd)
                argv[argv.index("-n") + 1] = str(nodes * per_node)
            proc = subprocess.run(argv, check=False, env=env,
                                  timeout=timeout + 10, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{nodes}x{per_node} at {rate}: mpiexec exited "
                               f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def run_ddp(nodes, per_node, rate, repeats, placement="block"):
    """benchmarks/ddp.py (hpcgrad only) across the nodes: its JSON (step, compute-only step,
    all-reduce of the gradient's bytes: (median, min) seconds; bytes; buckets)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
    from cluster import Cluster

    cmd = [sys.executable, os.path.join(HERE, "ddp.py"), "--no-torch", "--json",
           "--repeats", str(repeats)]
    with Cluster(nodes, rate=rate) as cluster:
        env = {**os.environ, **cluster.mpi_env(), "MPIEXEC_TIMEOUT": "240"}
        for name in ("HPCGRAD_HIERARCHICAL_ALLREDUCE", "HPCGRAD_PROGRESS_THREAD"):
            env.pop(name, None)
        if placement == "block":
            argv = cluster.mpiexec_argv(nodes * per_node, cmd)
        else:
            argv = cluster.mpiexec_argv(nodes, cmd)
            argv[argv.index("-n") + 1] = str(nodes * per_node)
        proc = subprocess.run(argv, check=False, env=env, timeout=250, capture_output=True,
                              text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ddp {nodes}x{per_node}: mpiexec exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])["hpcgrad"]
    return {"nodes": nodes, "ranks": nodes * per_node, "placement": placement, "rate": rate,
            "ddp": figures}


def human(nbytes):
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def busbw(nbytes, seconds, p):
    return 2 * (p - 1) / p * nbytes / seconds / 1e9


def print_table(result, rate):
    p, nodes = result["ranks"], result["nodes"]
    note = f"oversubscribed: {p} ranks on 2 cores" if p > 2 else "2 cores"
    load = result.get("load")
    print(f"{nodes} node(s) x {p // nodes} ranks ({result['placement']} placement), link "
          f"{rate or 'unshaped'} per node ({note}"
          + (f"; load average {load[0]:.1f} at the end)" if load else ")"))
    head = (f"{'size':>7} {'flat ms':>9} {'hier ms':>9} {'raw ms':>9} {'flat GB/s':>10} "
            f"{'hier GB/s':>10} {'speed-up':>10}")
    print(head)
    print("-" * len(head))
    for row in result["rows"]:
        n, t = row["bytes"], row["seconds"]
        print(f"{human(n):>7} {t['flat'] * 1e3:9.3f} {t['hier'] * 1e3:9.3f} {t['raw'] * 1e3:9.3f} "
              f"{busbw(n, t['flat'], p):10.3f} {busbw(n, t['hier'], p):10.3f} "
              f"{t['flat'] / t['hier']:9.2f}x")
    print()


def parse_layout(text):
    try:
        nodes, per_node = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is NODESxRANKS_PER_NODE, e.g. 2x2, got "
                                         f"{text!r}") from None
    return nodes, per_node


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=[(2, 2), (4, 2)],
                   metavar="NxR", help="nodes x ranks per node (default 2x2 4x2)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each node's link "
                   "(default 1gbit; 'none': unshaped)")
    p.add_argument("--placement", choices=["block", "cyclic"], default="block",
                   help="block: a node's ranks are consecutive (mpiexec's and Slurm's default); "
                   "cyclic: rank r on node r %% N")
    p.add_argument("--sizes", nargs="+", type=int, default=TABLE_SIZES, help="bytes")
    p.add_argument("--fit-sizes", action="store_true", help="add 4, 64, 256 KB (the latency "
                   "side; benchmarks/scaling.py --validate fits from 1 MB up)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget", type=float, default=30.0, help="seconds of timed repetitions "
                   "per layout; fewer repeats when it runs out (the JSON says how many)")
    p.add_argument("--json", metavar="FILE", help="write every layout's results here")
    p.add_argument("--ddp", action="store_true", help="instead: benchmarks/ddp.py's MLP step "
                   "(hpcgrad DDP, 784-1024-1024-10, batch 256 per rank) on each layout")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    rate = None if args.rate == "none" else args.rate
    sizes = sorted(set(args.sizes) | (set(FIT_SIZES) if args.fit_sizes else set()))
    results = []
    if args.ddp:
        for nodes, per_node in args.layouts:
            result = run_ddp(nodes, per_node, rate, args.repeats, args.placement)
            results.append(result)
            f = result["ddp"]
            print(f"DDP MLP, {nodes} node(s) x {per_node} ranks ({args.placement}), "
                  f"{rate or 'unshaped'}: step {f['step'][0] * 1e3:.1f} ms, compute only "
                  f"{f['compute'][0] * 1e3:.1f} ms, all-reduce {f['bytes'] / MB:.2f} MB "
                  f"{f['comm'][0] * 1e3:.1f} ms, {f['buckets']} buckets")
            sys.stdout.flush()
    for nodes, per_node in [] if args.ddp else args.layouts:
        result = run_layout(nodes, per_node, rate, sizes, args.repeats, args.warmup, args.budget,
                            args.placement)
        result["rate"], result["placement"] = rate, args.placement
        results.append(result)
        print_table(result, rate)
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": rate, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load": os.getloadavg(), "ddp" if args.ddp else "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
