"""Predicted DDP step time and parallel efficiency for 8 to 4,096 ranks, from the alpha-beta model.

The model is hpcgrad/distributed/model.py (Note [The scaling model]): ring, recursive-doubling
and hierarchical all-reduce, and a DDP step whose buckets are reduced, in order, while backward
runs. Weak scaling: each rank keeps its batch, so efficiency = one-rank step / p-rank step.

    python benchmarks/scaling.py                         # table, stated fabrics
    python benchmarks/scaling.py --plot scaling.png      # + efficiency vs ranks (matplotlib)
    python benchmarks/scaling.py --fit-json comm.json    # alpha, beta from benchmarks/comm.py --json
    mpiexec -n 2 python benchmarks/scaling.py --fit      # measure Allreduce here, fit, predict

Stated inputs (change them with the options):
  * gradients, float32: the MLP 784-1024-1024-10 and the CNN of benchmarks/training.py
    (1,863,690 and 9,098 parameters) and a ResNet-50-sized 25.5 M;
  * compute per step on one rank: MLP 33.6 ms and CNN 12.8 ms (benchmarks/training.py, hpcgrad,
    one thread, batch 256 and 64, on this machine), ResNet-50 100 ms (a GPU at batch 32: an
    assumption, not a measurement); split forward 30%, backward 60%, optimizer 10%;
  * fabrics: 100 Gbit/s InfiniBand between nodes (alpha 1.5 us), 10 Gbit/s Ethernet (alpha
    25 us); within a node shared memory (alpha 0.5 us, 200 Gbit/s); gamma (the sum) 10 GB/s;
    8 ranks per node; DDP buckets of 1 MB then 25 MB.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hpcgrad.distributed import model

FLOAT = 4
GRADIENTS = {  # name: (parameters, compute seconds per step on one rank)
    "MLP": (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10, 33.6e-3),
    "CNN": (1 * 8 * 9 + 8 + 8 * 16 * 9 + 16 + 16 * 7 * 7 * 10 + 10, 12.8e-3),
    "ResNet-50": (25_500_000, 100e-3),
}
SPLIT = (0.3, 0.6, 0.1)  # forward, backward, optimizer shares of the compute
RANKS = [2 ** k for k in range(3, 13)]  # 8 .. 4096


def fabrics(gamma):
    return [model.Fabric.from_bandwidth("IB 100 Gbit/s", 1.5, 100, gamma),
            model.Fabric.from_bandwidth("Ethernet 10 Gbit/s", 25, 10, gamma)]


def algorithms(inter, intra, per_node, overhead):
    """name -> allreduce(nbytes, p) seconds; ``overhead`` is added per call (Python's share)."""
    def hier(n, p):
        nodes, r = max(1, p // per_node), min(p, per_node)
        return model.hierarchical_allreduce(n, nodes, r, intra, inter)
    def link(p):  # a flat ring or tree within one node never touches the network
        return intra if p <= per_node else inter
    return {"ring": lambda n, p: model.ring_allreduce(n, p, link(p)) + overhead,
            "tree": lambda n, p: model.tree_allreduce(n, p, link(p)) + overhead,
            "hier": lambda n, p: hier(n, p) + overhead}


def predict(params, compute, allreduce, p):
    f, b, o = (share * compute for share in SPLIT)
    return model.ddp_step(model.buckets(params * FLOAT), f, b, o, lambda n: allreduce(n, p))


def table(inter, intra, per_node, overhead, ranks):
    """Rows of (gradient, ranks, {algorithm: Step}) and the printed lines."""
    algos = algorithms(inter, intra, per_node, overhead)
    rows, lines = [], []
    head = f"{'gradient':>10} {'MB':>7} {'ranks':>6}" + "".join(
        f" {name + ' ms':>10} {name + ' eff':>9}" for name in algos)
    lines += [(f"{inter.name} (alpha {inter.alpha * 1e6:.2f} us, {1 / inter.beta / 1e9:.2f} GB/s), "
              f"in-node {intra.name} (alpha {intra.alpha * 1e6:.2f} us, "
              f"{1 / intra.beta / 1e9:.2f} GB/s), gamma "
              f"{1 / inter.gamma / 1e9 if inter.gamma else float('inf'):.1f} GB/s, "
              f"{per_node} ranks/node, +{overhead * 1e6:.1f} us per all-reduce"), head,
              "-" * len(head)]
    for name, (params, compute) in GRADIENTS.items():
        for p in ranks:
            steps = {a: predict(params, compute, run, p) for a, run in algos.items()}
            rows.append((name, p, steps))
            lines.append(f"{name:>10} {params * FLOAT / 1e6:7.2f} {p:6d}" + "".join(
                f" {s.step * 1e3:10.2f} {s.efficiency * 100:8.1f}%" for s in steps.values()))
    return rows, lines


def fit_from_json(path):
    """(alpha, beta, ranks) from benchmarks/comm.py --json output (its raw Allreduce column)."""
    with open(path) as f:
        data = json.load(f)
    sizes = [row["bytes"] for row in data["rows"]]
    seconds = [row["seconds"]["raw"] for row in data["rows"]]
    return (*model.fit_alpha_beta(sizes, seconds, data["ranks"]), data["ranks"])


def measure_and_fit(repeats=11):
    """Time comm.Allreduce (mpi4py, in place, float32) at 4 KB..16 MB on every rank of this
    mpiexec job; (alpha, beta, ranks, rows) from the medians of the slowest rank's times."""
    from mpi4py import MPI  # only this mode needs MPI: the predictions run without it
    comm = MPI.COMM_WORLD
    sizes = [4096 * 4 ** k for k in range(7)]
    rows = []
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        k = max(1, min(100, (256 << 10) // nbytes))  # back-to-back calls: a latency is not a tick
        times = []
        for _ in range(repeats + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                comm.Allreduce(MPI.IN_PLACE, buf)
            times.append((time.perf_counter() - t0) / k)
        slowest = comm.allreduce(float(np.median(times[1:])), op=MPI.MAX)
        rows.append((nbytes, slowest))
    p = comm.Get_size()
    alpha, beta = model.fit_alpha_beta([r[0] for r in rows], [r[1] for r in rows], p)
    return alpha, beta, p, rows, comm.Get_rank()


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in GRADIENTS:
        mine = [(p, steps) for g, p, steps in rows if g == name]
        for algo, style in zip(mine[0][1], ("-", "--", ":")):
            ax.plot([p for p, _ in mine], [s[algo].efficiency * 100 for _, s in mine],
                    style, marker="o", markersize=3, label=f"{name} {algo}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("parallel efficiency (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="under mpiexec: measure comm.Allreduce "
                   "and fit alpha, beta (printed, and used as the in-node fabric)")
    p.add_argument("--fit-json", metavar="FILE", help="fit alpha, beta from benchmarks/comm.py "
                   "--json FILE instead (used as the in-node fabric)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--gamma-gbs", type=float, default=10.0, help="reduction speed, GB/s "
                   "(0: free)")
    p.add_argument("--overhead-us", type=float, default=0.0, help="added to every all-reduce "
                   "(e.g. hpcgrad's per-call Python cost from benchmarks/comm.py --overhead)")
    p.add_argument("--plot", metavar="PATH", help="efficiency vs ranks, first fabric (PNG)")
    args = p.parse_args(argv)
    gamma = 1 / (args.gamma_gbs * 1e9) if args.gamma_gbs > 0 else 0.0
    intra = model.Fabric.from_bandwidth("shared memory", 0.5, 200, gamma)
    if args.fit or args.fit_json:
        if args.fit:
            alpha, beta, nranks, measured, rank = measure_and_fit()
            if rank != 0:
                return
        else:
            alpha, beta, nranks = fit_from_json(args.fit_json)
            measured = None
        print(f"fit over {nranks} ranks: alpha {alpha * 1e6:.2f} us, beta {beta * 1e9:.4f} ns/B "
              f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s, gamma included)")
        if measured:
            fitted = model.Fabric("fit", alpha, beta)
            print(f"{'bytes':>10} {'measured us':>12} {'model us':>10} {'error':>7}")
            for nbytes, t in measured:
                m = model.ring_allreduce(nbytes, nranks, fitted)
                print(f"{nbytes:10d} {t * 1e6:12.1f} {m * 1e6:10.1f} {(m - t) / t * 100:6.1f}%")
        # the fit folds gamma into beta: keep it there, not twice
        intra = model.Fabric("fitted here", alpha, beta, 0.0)
        print()
    all_rows = []
    for fabric in fabrics(gamma):
        rows, lines = table(fabric, intra, args.ranks_per_node, args.overhead_us * 1e-6, RANKS)
        all_rows.append((fabric, rows))
        print("\n".join(lines))
        print()
    if args.plot:
        fabric, rows = all_rows[0]
        plot(rows, args.plot, f"DDP weak scaling, {fabric.name}, {args.ranks_per_node} ranks/node "
                              "(model)")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
