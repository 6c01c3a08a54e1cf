"""DDP step time on 2 ranks: step, compute-only step, all-reduce of the same bytes, and the overlap.

    mpiexec -n 2 python benchmarks/ddp.py            # hpcgrad, and PyTorch DDP (gloo) if installed
    mpiexec -n 2 python benchmarks/ddp.py --quick    # a smoke run

overlap = (compute + comm - step) / comm: the share of the gradient all-reduce hidden behind
backward (1 = fully hidden, 0 = none). One thread per rank; medians of --repeats steps.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpcgrad as hg  # noqa: E402
import hpcgrad.distributed as dist  # noqa: E402
import hpcgrad.nn as nn  # noqa: E402
import hpcgrad.nn.functional as F  # noqa: E402
from hpcgrad.nn.parallel import DistributedDataParallel  # noqa: E402

COMM = MPI.COMM_WORLD


def median_time(step, repeats, warmup=2):
    times = []
    for i in range(warmup + repeats):
        COMM.Barrier()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        slowest = COMM.allreduce(elapsed, op=MPI.MAX)  # a step is as slow as its slowest rank
        if i >= warmup:
            times.append(slowest)
    return float(np.median(times)), float(np.min(times))


def hpcgrad_figures(sizes, batch, repeats, lr=0.01, bucket_view=False):
    rng = np.random.default_rng(COMM.Get_rank())
    x = hg.tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    y = hg.tensor(rng.integers(0, sizes[-1], batch))

    def mlp():
        hg.manual_seed(0)
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    def step_of(model, zero_in_place=False):
        params = list(model.parameters())

        def step():
            loss = F.cross_entropy(model(x), y)
            for p in params:  # in place keeps a bucket view the gradient (zero_grad(False))
                if zero_in_place and p.grad is not None:
                    p.grad.data[...] = 0
                else:
                    p.grad = None
            loss.backward()
            for p in params:
                p.data -= lr * p.grad.data
        return step

    compute = median_time(step_of(mlp()), repeats)
    ddp = DistributedDataParallel(mlp(), gradient_as_bucket_view=bucket_view)
    step = median_time(step_of(ddp, zero_in_place=bucket_view), repeats)
    flat = np.zeros(sum(p.data.size for p in ddp.parameters()), np.float32)
    comm = median_time(lambda: dist.all_reduce(flat), repeats)
    return {"step": step, "compute": compute, "comm": comm, "bytes": flat.nbytes,
            "buckets": len(ddp.reducer.buckets)}


def torch_figures(sizes, batch, repeats, lr=0.01):
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    tdist.init_process_group("gloo", rank=COMM.Get_rank(), world_size=COMM.Get_size())
    rng = np.random.default_rng(COMM.Get_rank())
    x = torch.tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    y = torch.tensor(rng.integers(0, sizes[-1], batch))

    def mlp():
        torch.manual_seed(0)
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    def step_of(model):
        params = list(model.parameters())

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            for p in params:
                p.grad = None
            loss.backward()
            with torch.no_grad():
                for p in params:
                    p -= lr * p.grad
        return step

    compute = median_time(step_of(mlp()), repeats)
    step = median_time(step_of(torch.nn.parallel.DistributedDataParallel(mlp())), repeats)
    flat = torch.zeros(sum(p.numel() for p in mlp().parameters()))
    comm = median_time(lambda: tdist.all_reduce(flat), repeats)
    tdist.destroy_process_group()
    return {"step": step, "compute": compute, "comm": comm, "bytes": flat.numel() * 4}


def overlap(f):
    return (f["compute"][0] + f["comm"][0] - f["step"][0]) / f["comm"][0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sizes = [784, 1024, 1024, 10]
    if args.quick:
        sizes, args.batch, args.repeats = [784, 128, 10], 32, 3
    results = {"hpcgrad": hpcgrad_figures(sizes, args.batch, args.repeats),
               "hpcgrad, grad as bucket view": hpcgrad_figures(sizes, args.batch, args.repeats,
                                                               bucket_view=True)}
    if not args.no_torch:
        results["torch"] = torch_figures(sizes, args.batch, args.repeats)
    if COMM.Get_rank() != 0:
        return
    if args.json:
        print(json.dumps(results))
        return
    print(f"DDP on {COMM.Get_size()} ranks, MLP {'-'.join(map(str, sizes))}, batch {args.batch} "
          f"per rank, float32, one thread per rank; median (min) of {args.repeats} steps, ms")
    print(f"{'':30}{'step':>18}{'compute only':>18}{'allreduce':>18}{'overlap':>10}")
    for name, f in results.items():
        if f is None:
            print(f"{name:30}  not installed")
            continue
        cells = "".join(f"{f[k][0] * 1e3:11.2f} ({f[k][1] * 1e3:5.1f})" for k in
                        ("step", "compute", "comm"))
        print(f"{name:30}{cells}{overlap(f):10.0%}")
    if results.get("torch"):
        ratio = results["hpcgrad"]["step"][0] / results["torch"]["step"][0]
        print(f"step time ratio hpcgrad / torch DDP (gloo): {ratio:.2f}x")
    print(f"gradient bytes: {results['hpcgrad']['bytes'] / 1e6:.1f} MB in "
          f"{results['hpcgrad']['buckets']} buckets")


if __name__ == "__main__":
    main()
