"""DDP step time on 2 ranks: step, compute-only step, all-reduce of the same bytes, and the overlap.

    mpiexec -n 2 python benchmarks/ddp.py            # hpcgrad, and PyTorch DDP (gloo) if installed
    mpiexec -n 2 python benchmarks/ddp.py --quick    # a smoke run
    mpiexec -n 2 python benchmarks/ddp.py --timeline /tmp/ddp.json   # where the all-reduce runs

overlap = (compute + comm - step) / comm: the share of the gradient all-reduce hidden behind
backward (1 = fully hidden, 0 = none). One thread per rank; medians of --repeats steps.

--timeline PATH records a few steps with the timeline on (Note [Timeline], Note [DDP timeline]),
merges the ranks into PATH (open it in https://ui.perfetto.dev) and reads from it how much of
the time an all-reduce was in flight fell inside backward's computation, beside what
DistributedDataParallel._get_ddp_logging_data measured over the same steps.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib
import functools
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpcgrad as hg  # noqa: E402
import hpcgrad.distributed as dist  # noqa: E402
import hpcgrad.nn as nn  # noqa: E402
import hpcgrad.nn.functional as F  # noqa: E402
from hpcgrad.nn.parallel import DistributedDataParallel  # noqa: E402
from hpcgrad.base.timeline import TIMELINE, merge

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


def hpcgrad_mlp(sizes):
    hg.manual_seed(0)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def hpcgrad_batch(sizes, batch):
    rng = np.random.default_rng(COMM.Get_rank())
    x = hg.tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    return x, hg.tensor(rng.integers(0, sizes[-1], batch))


def hpcgrad_step(model, x, y, lr=0.01, zero_in_place=False, span=TIMELINE.span):
    params = list(model.parameters())

    def step():
        with span("forward", "step"):
            loss = F.cross_entropy(model(x), y)
        for p in params:  # in place keeps a bucket view the gradient (zero_grad(False))
            if zero_in_place and p.grad is not None:
                p.grad.array[...] = 0
            else:
                p.grad = None
        with span("backward", "step"):
            loss.backward()
        for p in params:
            p.data -= lr * p.grad.data
    return step


def hpcgrad_figures(sizes, batch, repeats, lr=0.01, bucket_view=False, static_graph=False):
    x, y = hpcgrad_batch(sizes, batch)
    mlp = functools.partial(hpcgrad_mlp, sizes)

    def step_of(model, zero_in_place=False):
        return hpcgrad_step(model, x, y, lr, zero_in_place, span=_no_span)

    compute = median_time(step_of(mlp()), repeats)
    ddp = DistributedDataParallel(mlp(), gradient_as_bucket_view=bucket_view,
                                  static_graph=static_graph)
    step = median_time(step_of(ddp, zero_in_place=bucket_view), repeats)
    flat = np.zeros(sum(p.array.size for p in ddp.parameters()), np.float32)
    comm = median_time(lambda: dist.all_reduce(flat), repeats)
    return {"step": step, "compute": compute, "comm": comm, "bytes": flat.nbytes,
            "buckets": len(ddp.reducer.buckets)}


def _no_span(*args, **kwargs):
    return contextlib.nullcontext()


def _intervals(events):
    """{(name, bucket): [(begin, end), ...]} of one rank's span events (B/E, and the async b/e
    of bucket all-reduces), in microseconds."""
    open_spans, spans = {}, {}
    for e in sorted(events, key=lambda e: e["ts"]):
        key = (e["name"], e.get("args", {}).get("bucket"))
        if e["ph"] in "Bb":
            open_spans.setdefault(key, []).append(e["ts"])
        elif e["ph"] in "Ee" and open_spans.get(key):
            spans.setdefault(key, []).append((open_spans[key].pop(), e["ts"]))
    return spans


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def trace_overlap(events):
    """Per rank, summed over its backwards: (backward compute, all-reduce in flight, the part
    of it inside backward compute), microseconds, from a merged trace's events.

    Backward compute runs from a "backward" span's start to its "finalize" span's start (the
    engine's final callback); an all-reduce is in flight from its launch to the return of
    finalize's wait for it; all-reduces in flight together count once.
    """
    figures = {}
    for rank in sorted({e["pid"] for e in events if e["ph"] in "BEbe"}):
        spans = _intervals([e for e in events if e["pid"] == rank and e["ph"] in "BEbe"])
        finalizes = sorted(spans.get(("finalize", None), []))
        comm = _union(i for (name, _), found in spans.items() if name == "allreduce"
                      for i in found)
        compute = in_flight = hidden = 0.0
        for begin, end in spans.get(("backward", None), []):
            stop = next((f[0] for f in finalizes if begin <= f[0] <= end), end)
            compute += stop - begin
            for a, b in comm:
                if begin <= a <= end:
                    in_flight += b - a
                    hidden += max(0.0, min(b, stop) - max(a, begin))
        figures[rank] = (compute, in_flight, hidden)
    return figures


def timeline_figures(sizes, batch, path, steps=5):
    """Steps with the timeline on; rank 0 merges the ranks' files into ``path`` and reports."""
    ddp = DistributedDataParallel(hpcgrad_mlp(sizes))
    step = hpcgrad_step(ddp, *hpcgrad_batch(sizes, batch))
    for _ in range(2):
        step()  # kernels compiled and buckets rebuilt before anything is recorded
    before = ddp._get_ddp_logging_data()
    TIMELINE.path, TIMELINE.rank, TIMELINE.enabled = path, COMM.Get_rank(), True
    for i in range(steps):
        COMM.Barrier()
        with TIMELINE.span("step", "step", step=i + 1):
            step()
    TIMELINE.save()
    TIMELINE.enabled = False
    after = ddp._get_ddp_logging_data()
    # Averages over the synced iterations but the first: these steps' own, in ms.
    logged = {key: (after[key] * (after["iteration"] - 1) - before[key] * (before["iteration"] - 1))
              / steps / 1e6 for key in ("avg_backward_compute_time", "avg_backward_comm_time",
                                        "avg_backward_compute_comm_overlap_time")}
    logged = COMM.gather(logged, root=0)
    COMM.Barrier()  # every rank's file is written
    if COMM.Get_rank() != 0:
        return
    merge(path)
    with open(path, encoding="utf-8") as f:
        figures = trace_overlap(json.load(f)["traceEvents"])
    print(f"DDP on {COMM.Get_size()} ranks, MLP {'-'.join(map(str, sizes))}, batch {batch} per "
          f"rank, {len(ddp.reducer.buckets)} buckets: timeline of {steps} steps in {path} "
          "(open it in https://ui.perfetto.dev)")
    print("per step, ms    backward compute   all-reduce in flight   of it during backward")
    for rank, (compute, in_flight, hidden) in figures.items():
        share = f"{hidden / in_flight:.0%}" if in_flight else "-"
        print(f"rank {rank:<10}{compute / steps / 1e3:17.2f}{in_flight / steps / 1e3:23.2f}"
              f"{hidden / steps / 1e3:17.2f} ({share})")
    if not any(hidden > 0.01 * in_flight for _, in_flight, hidden in figures.values()):
        print("none of the all-reduce time overlapped backward: every bucket became ready at "
              "its end")
    print("(in flight: from its launch to the return of finalize's wait, which includes "
          "waiting for the slowest rank's gradients; MPICH moves it only inside MPI calls unless "
          "a progress thread runs: HPCGRAD_PROGRESS_THREAD=1, Note [Communication progress])")
    print("the same steps in _get_ddp_logging_data (comm: first launch to the last wait's "
          "return; overlap: first launch to the end of backward compute), ms:")
    for rank, data in enumerate(logged):
        print(f"rank {rank:<10} backward compute {data['avg_backward_compute_time']:.2f}"
              f"  comm {data['avg_backward_comm_time']:.2f}"
              f"  overlap {data['avg_backward_compute_comm_overlap_time']:.2f}")


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
    static = median_time(step_of(torch.nn.parallel.DistributedDataParallel(
        mlp(), static_graph=True)), repeats)
    flat = torch.zeros(sum(p.numel() for p in mlp().parameters()))
    comm = median_time(lambda: tdist.all_reduce(flat), repeats)
    tdist.destroy_process_group()
    figures = {"step": step, "compute": compute, "comm": comm, "bytes": flat.numel() * 4}
    return figures, {**figures, "step": static}


def overlap(f):
    return (f["compute"][0] + f["comm"][0] - f["step"][0]) / f["comm"][0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", metavar="PATH", help="record a few steps with the timeline on "
                   "into PATH and print how much of the all-reduce overlapped backward")
    args = p.parse_args()
    sizes = [784, 1024, 1024, 10]
    if args.quick:
        sizes, args.batch, args.repeats = [784, 128, 10], 32, 3
    if args.timeline:
        timeline_figures(sizes, args.batch, args.timeline)
        return
    results = {"hpcgrad": hpcgrad_figures(sizes, args.batch, args.repeats),
               "hpcgrad, grad as bucket view": hpcgrad_figures(sizes, args.batch, args.repeats,
                                                               bucket_view=True),
               "hpcgrad, static_graph": hpcgrad_figures(sizes, args.batch, args.repeats,
                                                        static_graph=True)}
    if not args.no_torch:
        results["torch"], results["torch, static_graph"] = (
            torch_figures(sizes, args.batch, args.repeats) or (None, None))
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
        ratio = (results["hpcgrad, static_graph"]["step"][0]
                 / results["torch, static_graph"]["step"][0])
        print(f"step time ratio with static_graph=True, hpcgrad / torch: {ratio:.2f}x")
    print(f"gradient bytes: {results['hpcgrad']['bytes'] / 1e6:.1f} MB in "
          f"{results['hpcgrad']['buckets']} buckets")


if __name__ == "__main__":
    main()
