"""Distributed autograd round trip: hpcgrad over MPI, PyTorch's dist_autograd over TensorPipe beside it.

    mpiexec -n 2 python benchmarks/dist_autograd.py             # both libraries, a few minutes
    mpiexec -n 2 python benchmarks/dist_autograd.py --quick     # a smoke run, seconds
    mpiexec -n 2 python benchmarks/dist_autograd.py --no-torch  # hpcgrad only
    mpiexec -n 2 python benchmarks/dist_autograd.py --profile prof.out   # cProfile of rank 0's part
    mpiexec -n 2 python benchmarks/dist_autograd.py --malloc-default     # glibc's malloc untouched

One iteration, timed on rank 0: in a fresh autograd context, ``y = rpc_sync(worker1, stage, x)``
where rank 1 computes ``tanh(x @ W)`` with its own W (requires grad), then ``y.sum()`` and
``dist_autograd.backward(ctx, [loss])``, which sends the gradient of y to rank 1 and brings the
gradient of x back; leaving the context releases it on both ranks. Sizes: x 1x8 with W 8x8 (the
latency of the machinery) and x 256x1024 with W 1024x1024, float32 (1 MB each way, twice).
Rank 1 only serves, waiting where ``rpc.shutdown()`` waits (Note [Serving threads] in
rpc/agent.py). One BLAS/OpenMP thread per rank (two ranks on two cores), and glibc's malloc
keeping freed memory in both processes (Note [Keeping freed memory] in utils/memory.py; both
libraries run in them, so it applies to both alike; ``--malloc-default`` leaves it).

Both RPC systems run at once and take turns: each of ``--rounds`` rounds times a block of
iterations of each library (which goes first alternates), so a change in the machine's load
hits both alike. Inside a block every round trip is followed by one "local" iteration: the same
forward and backward in one process (no RPC). Figures: medians of every timed iteration
(minimum beside them); the ratio is the median over rounds of (hpcgrad's median / PyTorch's
median) in that round, with the range of those per-round ratios. "overhead", what the
communication adds, is the median over all of a library's iterations of (round trip - the local
iteration right after it): pairs, because the compute of a 256x1024 iteration moves by a
millisecond or more from one second to the next on a shared machine, far more than the
overhead. Its ratio is that of the two libraries' medians over all rounds (a round's median
of 20 differences can be near zero or below it: their ratios, in the range column, are too
noisy to take a median of); "unpaired" is the overhead as it was taken before: per round the
difference of the two medians, and the median of their ratios.
The message count is of hpcgrad's MPI messages, both ranks, per 1x8 round trip, by kind
("+kind": messages carried inside another one, costing no MPI message: Note [Carried messages]
in rpc/agent.py).
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
from hpcgrad.base.memory import keep_freed_memory  # noqa: E402

try:
    import torch
except ImportError:  # the torch column is left out
    torch = None

SIZES = {"1x8": ((1, 8), (8, 8)), "256x1024": ((256, 1024), (1024, 1024))}
TARGETS = {("1x8", "round trip"): 0.5, ("256x1024", "overhead"): 0.5}  # hpcgrad / PyTorch, at most
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


def local_iteration(lib, x, w):
    """The round trip's compute without RPC: forward, backward, the gradient of x."""
    if lib == "hpcgrad":
        x.grad = w.grad = None
        (x @ w).tanh().sum().backward()
    else:
        x.grad = w.grad = None
        torch.tanh(x @ w).sum().backward()
    return x.grad


def time_pairs(first, second, iterations, warmup):
    """Seconds of ``first()`` and of ``second()`` right after it, ``iterations`` times each,
    after ``warmup`` untimed pairs: two lists."""
    for _ in range(warmup):
        first()
        second()
    gc.collect()
    times = ([], [])
    for _ in range(iterations):
        for step, out in ((first, times[0]), (second, times[1])):
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
    return times


def start_rpc(lib, rank):
    if lib == "hpcgrad":
        hg_rpc.init_rpc(f"worker{rank}")
        return
    from torch.distributed import rpc
    torch.set_num_threads(1)
    port = comm_world().bcast(_free_port() if rank == 0 else None, root=0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=comm_world().Get_size(),
                 rpc_backend_options=options)


def stop_rpc(lib):
    if lib == "hpcgrad":
        hg_rpc.shutdown()
    else:
        from torch.distributed import rpc
        rpc.shutdown()


def inputs(lib):
    """{size: (x, a local W)} for ``lib``."""
    out = {}
    for size, (x_shape, w_shape) in SIZES.items():
        rng = np.random.default_rng(1)
        w = (rng.standard_normal(w_shape) / np.sqrt(w_shape[0])).astype(np.float32)
        if lib == "hpcgrad":
            out[size] = (hg.tensor(np.ones(x_shape, np.float32), requires_grad=True),
                         hg.tensor(w, requires_grad=True))
        else:
            out[size] = (torch.ones(x_shape, requires_grad=True),
                         torch.tensor(w, requires_grad=True))
    return out


def run_rounds(libs, args):
    """On rank 0: {(lib, what, size): [per-round lists of times]}, libraries taking turns."""
    data = {lib: inputs(lib) for lib in libs}
    iteration = {"hpcgrad": hg_iteration, "torch": torch_iteration}
    results = {}
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
    for r in range(args.rounds):
        order = libs if r % 2 == 0 else libs[::-1]
        for size in SIZES:
            iters = args.iterations[size]
            for lib in order:
                x, w = data[lib][size]
                if profiler is not None and lib == "hpcgrad":
                    profiler.enable()
                trips, local = time_pairs(
                    lambda lib=lib, x=x, size=size: iteration[lib](x, size),
                    lambda lib=lib, x=x, w=w: local_iteration(lib, x, w),
                    iters, max(iters // 10, 2))
                if profiler is not None:
                    profiler.disable()
                results.setdefault((lib, "round trip", size), []).append(trips)
                results.setdefault((lib, "local", size), []).append(local)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return results


def count_messages(rank, iterations=100):
    """Rank 0: (MPI messages, {kind: envelopes}) of one 1x8 round trip, both ranks together."""
    agent = hg_rpc._require_agent()
    agent.join(60)  # every rank here: nothing else in flight
    start = agent.messages_sent
    kinds = getattr(agent, "sent_by_kind", None)  # older agents counted only the total
    kinds_start = dict(kinds or {})
    if rank == 0:
        x = hg.tensor(np.ones(SIZES["1x8"][0], np.float32), requires_grad=True)
        for _ in range(iterations):
            hg_iteration(x, "1x8")
    agent.join(60)
    by_kind = {k: v - kinds_start.get(k, 0) for k, v in (kinds or {}).items()}
    gathered = comm_world().gather((agent.messages_sent - start, by_kind), root=0)
    if rank != 0:
        return None
    total = sum(n for n, _ in gathered) / iterations
    merged = {}
    for _, kinds_of_rank in gathered:
        for k, v in kinds_of_rank.items():
            merged[k] = merged.get(k, 0) + v / iterations
    return total, {k: v for k, v in merged.items() if v}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few iterations (a smoke run)")
    p.add_argument("--no-torch", action="store_true", help="hpcgrad only")
    p.add_argument("--rounds", type=int, default=7, help="rounds of turns (default 7)")
    p.add_argument("--tiny-iterations", type=int, default=300, help="1x8 iterations per turn")
    p.add_argument("--large-iterations", type=int, default=20,
                   help="256x1024 iterations per turn")
    p.add_argument("--profile", metavar="FILE", help="cProfile rank 0's hpcgrad round trips")
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc as it is (by default both libraries' processes "
                        "keep freed memory: hpcgrad.base.memory.keep_freed_memory)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tiny_iterations, args.large_iterations = 2, 50, 3
    args.iterations = {"1x8": args.tiny_iterations, "256x1024": args.large_iterations}
    return args


def fmt(seconds):
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def report(results, libs, messages, args):
    med = statistics.median
    both = "torch" in libs

    def pooled(lib, what, size):
        return [t for block in results[lib, what, size] for t in block]

    def per_round(lib, what, size, minus=None):
        rounds = [med(b) for b in results[lib, what, size]]
        if minus is not None:
            rounds = [a - med(b) for a, b in zip(rounds, results[lib, minus, size])]
        return rounds

    def differences(lib, size):
        """Per round: each round trip minus the local iteration right after it."""
        return [[a - b for a, b in zip(trips, local)] for trips, local in
                zip(results[lib, "round trip", size], results[lib, "local", size])]

    print(f"dist_autograd round trip, rank 0 -> rank 1 -> rank 0 (forward + backward); "
          f"torch {torch.__version__ if both else 'not run'}; {args.rounds} rounds of "
          f"{args.iterations} iterations per library, taking turns")
    print("malloc: " + ("glibc keeps freed memory in both libraries' processes "
                        "(hpcgrad.base.memory.keep_freed_memory; --malloc-default: not)"
                        if args.kept_memory else "glibc's defaults"))
    header = (f"{'input':<9} {'':<10} {'hpcgrad':>20} {'PyTorch (TensorPipe)':>22} "
              f"{'ratio':>6} {'rounds':>13} {'target':>6}")
    print(header)
    print("-" * len(header))
    for size in SIZES:
        for what in ("round trip", "local", "overhead", "unpaired"):
            target = TARGETS.get((size, what))
            if what == "overhead":  # medians of the pairs' differences, pooled and per round
                ours = [med(r) for r in differences("hpcgrad", size)]
                ours_all = [d for r in differences("hpcgrad", size) for d in r]
                row = f"{size:<9} {what:<10} {fmt(med(ours_all)):>20}"
                if both:
                    theirs = [med(r) for r in differences("torch", size)]
                    theirs_all = [d for r in differences("torch", size) for d in r]
                    ratios = [a / b for a, b in zip(ours, theirs)]
                    row += (f" {fmt(med(theirs_all)):>22} {med(ours_all) / med(theirs_all):>5.2f}x"
                            f" {min(ratios):>5.2f}-{max(ratios):<5.2f}x"
                            f" {'' if target is None else f'{target:.1f}x':>6}")
                print(row)
                continue
            if what == "unpaired":  # the overhead as it was taken before: medians' difference
                ours = per_round("hpcgrad", "round trip", size, minus="local")
                row = f"{size:<9} {what:<10} {fmt(med(ours)):>20}"
            else:
                ours_all = pooled("hpcgrad", what, size)
                ours = per_round("hpcgrad", what, size)
                row = (f"{size:<9} {what:<10} {fmt(med(ours_all)):>10} "
                       f"({fmt(min(ours_all)):>7})")
            if both:
                if what == "unpaired":
                    theirs = per_round("torch", "round trip", size, minus="local")
                    row += f" {fmt(med(theirs)):>22}"
                else:
                    theirs_all = pooled("torch", what, size)
                    theirs = per_round("torch", what, size)
                    row += f" {fmt(med(theirs_all)):>12} ({fmt(min(theirs_all)):>7})"
                ratios = [a / b for a, b in zip(ours, theirs)]
                row += (f" {med(ratios):>5.2f}x {min(ratios):>5.2f}-{max(ratios):<5.2f}x"
                        f" {'' if target is None else f'{target:.1f}x':>6}")
            print(row)
    total, kinds = messages
    detail = ", ".join(f"{k} {v:g}" for k, v in sorted(kinds.items(),
                                                         key=lambda kv: kv[0][:1] == "+"))
    print(f"hpcgrad MPI messages per 1x8 round trip (both ranks): {total:g}"
          + (f" ({detail})" if detail else ""))


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
    # Process-wide, so for both libraries alike: Note [Keeping freed memory]
    args.kept_memory = not args.malloc_default and keep_freed_memory()
    for lib in libs:
        start_rpc(lib, rank)
    results = run_rounds(libs, args) if rank == 0 else None
    # Rank 1 waits here all along, as a callee parked in rpc.shutdown() does, and serves
    # hpcgrad's requests on this thread meanwhile (Note [Serving threads] in rpc/agent.py);
    # PyTorch's agent serves on its own threads whatever this one does.
    hg_rpc._require_agent().join(0)
    messages = count_messages(rank)
    for lib in libs:
        stop_rpc(lib)
    if rank == 0:
        report(results, libs, messages, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
