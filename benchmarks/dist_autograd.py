"""Distributed autograd round trip: hpcgrad over MPI, PyTorch's dist_autograd over TensorPipe beside it.

    mpiexec -n 2 python benchmarks/dist_autograd.py             # both libraries, about a minute
    mpiexec -n 2 python benchmarks/dist_autograd.py --quick     # a few seconds
    mpiexec -n 2 python benchmarks/dist_autograd.py --no-torch  # hpcgrad only
    mpiexec -n 2 python benchmarks/dist_autograd.py --profile prof.out   # cProfile of rank 0's part

One iteration, timed on rank 0: in a fresh autograd context, ``y = rpc_sync(worker1, stage, x)``
where rank 1 computes ``tanh(x @ W)`` with its own W (requires grad), then ``y.sum()`` and
``dist_autograd.backward(ctx, [loss])``, which sends the gradient of y to rank 1 and brings the
gradient of x back; leaving the context releases it on both ranks. Sizes: x 1x8 with W 8x8 (the
latency of the machinery) and x 256x1024 with W 1024x1024, float32 (1 MB each way, twice).
Rank 1 only serves. Figures are medians over many iterations after a warm-up (minimum beside
them); one BLAS/OpenMP thread per rank (two ranks on two cores). hpcgrad's RPC is shut down
before PyTorch's starts, so the two never compete for the cores.
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # before numpy or torch is imported

import argparse  # noqa: E402
import gc  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpcgrad as hg  # noqa: E402
import hpcgrad.distributed.autograd as hg_autograd  # noqa: E402
import hpcgrad.distributed.rpc as hg_rpc  # noqa: E402
from hpcgrad.comm.mpi import comm_world  # noqa: E402

try:
    import torch
except ImportError:  # the torch column is left out
    torch = None

SIZES = {"1x8": ((1, 8), (8, 8)), "256x1024": ((256, 1024), (1024, 1024))}
TARGETS = {"1x8": 0.3, "256x1024": 0.8}  # hpcgrad / PyTorch, at most
_W = {}  # rank 1's weights, per library and size


# --- what rank 1 runs ---------------------------------------------------------------------------
def hg_stage(x, size):
    w = _W.get(("hg", size))
    if w is None:
        rng = np.random.default_rng(1)
        w = _W["hg", size] = hg.tensor(rng.standard_normal(SIZES[size][1]).astype(np.float32)
                                       / np.float32(np.sqrt(SIZES[size][1][0])),
                                       requires_grad=True)
    return (x @ w).tanh()


def torch_stage(x, size):
    w = _W.get(("torch", size))
    if w is None:
        rng = np.random.default_rng(1)
        w = _W["torch", size] = torch.tensor(
            rng.standard_normal(SIZES[size][1]).astype(np.float32)
            / np.float32(np.sqrt(SIZES[size][1][0])), requires_grad=True)
    return torch.tanh(x @ w)


# --- one iteration, per library -----------------------------------------------------------------
def hg_iteration(x, size):
    with hg_autograd.context() as ctx:
        loss = hg_rpc.rpc_sync(1, hg_stage, args=(x, size)).sum()
        hg_autograd.backward(ctx, [loss])
        grad = hg_autograd.get_gradients(ctx)[x]
    return grad


def torch_iteration(x, size):
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", torch_stage, args=(x, size)).sum()
        dist_autograd.backward(ctx, [loss])
        grad = dist_autograd.get_gradients(ctx)[x]
    return grad


def time_iterations(step, iterations, warmup):
    """Seconds of each of ``iterations`` calls of ``step()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    gc.collect()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_library(lib, args, rank):
    """{size: per-iteration times} on rank 0 (None elsewhere); RPC started and stopped here."""
    results = {}
    if lib == "hpcgrad":
        hg_rpc.init_rpc(f"worker{rank}")
        make = lambda shape: hg.tensor(np.ones(shape, np.float32), requires_grad=True)  # noqa: E731
        iteration = hg_iteration
    else:
        import torch.distributed.rpc as rpc
        torch.set_num_threads(1)
        port = comm_world().bcast(_free_port() if rank == 0 else None, root=0)
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=comm_world().Get_size(),
                     rpc_backend_options=options)
        make = lambda shape: torch.ones(shape, requires_grad=True)  # noqa: E731
        iteration = torch_iteration
    if rank == 0:
        for size, (x_shape, _) in SIZES.items():
            x = make(x_shape)
            iters = args.iterations[size]
            profiler = None
            if args.profile and lib == "hpcgrad":
                import cProfile
                profiler = cProfile.Profile()
                profiler.enable()
            results[size] = time_iterations(lambda: iteration(x, size), iters, max(iters // 10, 3))
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"{args.profile}.{size}")
    if lib == "hpcgrad":
        results["messages"] = count_messages(rank, make)
        hg_rpc.shutdown()
    else:
        import torch.distributed.rpc as rpc
        rpc.shutdown()
    return results if rank == 0 else None


def count_messages(rank, make, iterations=100):
    """MPI messages (envelopes and payloads, both ranks) of one 1x8 round trip, on rank 0."""
    agent = hg_rpc._require_agent()
    agent.join(60)  # every rank here: nothing else in flight
    start = agent.messages_sent
    if rank == 0:
        x = make(SIZES["1x8"][0])
        for _ in range(iterations):
            hg_iteration(x, "1x8")
    agent.join(60)
    sent = comm_world().gather(agent.messages_sent - start, root=0)
    return None if rank != 0 else sum(sent) / iterations


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few iterations (a smoke run)")
    p.add_argument("--no-torch", action="store_true", help="hpcgrad only")
    p.add_argument("--tiny-iterations", type=int, default=2000)
    p.add_argument("--large-iterations", type=int, default=60)
    p.add_argument("--profile", metavar="PREFIX",
                   help="cProfile rank 0's hpcgrad part into PREFIX.<size>")
    args = p.parse_args(argv)
    if args.quick:
        args.tiny_iterations, args.large_iterations = 100, 5
    args.iterations = {"1x8": args.tiny_iterations, "256x1024": args.large_iterations}
    return args


def fmt(seconds):
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main(argv=None):
    args = parse_args(argv)
    comm = comm_world()
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        if rank == 0:
            print("run with 2 ranks: mpiexec -n 2 python benchmarks/dist_autograd.py",
                  file=sys.stderr)
        return 2
    libs = ["hpcgrad"] + ([] if args.no_torch or torch is None else ["torch"])
    results = {lib: run_library(lib, args, rank) for lib in libs}
    if rank != 0:
        return 0
    print(f"dist_autograd round trip, rank 0 -> rank 1 -> rank 0 (forward + backward), "
          f"medians (min); torch {torch.__version__ if 'torch' in libs else 'not run'}")
    header = f"{'input':<10} {'hpcgrad':>22} {'PyTorch (TensorPipe)':>24} {'ratio':>7} {'target':>7}"
    print(header)
    print("-" * len(header))
    for size in SIZES:
        ours = results["hpcgrad"][size]
        row = f"{size:<10} {fmt(statistics.median(ours)):>11} ({fmt(min(ours)):>8})"
        if "torch" in libs:
            theirs = results["torch"][size]
            ratio = statistics.median(ours) / statistics.median(theirs)
            row += (f" {fmt(statistics.median(theirs)):>13} ({fmt(min(theirs)):>8})"
                    f" {ratio:>6.2f}x {TARGETS[size]:>6.1f}x")
        print(row)
    print(f"MPI messages per 1x8 round trip (hpcgrad, both ranks): "
          f"{results['hpcgrad']['messages']:g}")
    print(f"iterations: {args.iterations}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
