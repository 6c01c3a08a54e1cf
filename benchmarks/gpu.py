"""GPU figures: divide-and-copy kernel vs device copy, device all-reduce, DDP step beside torch DDP.

    python benchmarks/gpu.py                    # 1 rank
    mpiexec -n 2 python benchmarks/gpu.py       # 2 ranks sharing the GPU(s), local rank -> device
    python benchmarks/gpu.py --quick            # a smoke run

Without a usable GPU (cupy missing or no device) it prints "no GPU: ..." and exits 0.

kernel: hpcgrad.kernels.cuda.scaled_copy on a 64 MB float32 array vs cudaMemcpyAsync
(device to device) of the same bytes; bandwidth = bytes read + written per second, timed with
CUDA events on the current stream; ratio = kernel / copy (target >= 0.8).
all-reduce: a 16 MB cupy array through hpcgrad.distributed.all_reduce, on the path the comm
layer chose (CUDA-aware, or staged through host memory: Note [CUDA-aware decision]); bus
bandwidth = 2 (n - 1) / n * bytes / time (bytes / time at 1 rank). When MPI is CUDA-aware, the
staged path is measured too.
DDP: step of benchmarks/training.py's MLP (forward, cross-entropy, zero_grad, backward, SGD),
batch per rank, beside torch DDP on the same GPU when torch has CUDA (NCCL at 1 rank; gloo with
CUDA tensors at 2, since NCCL refuses two ranks on one GPU). A step is as slow as its slowest
rank; medians (min) of short runs. Lines starting "kernel", "all-reduce" and "DDP" are what
tests/gpu.sh copies into its report.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcgrad.info import gpu_count

COMM = MPI.COMM_WORLD
MB = 1 << 20


def say(*args):
    if COMM.Get_rank() == 0:
        print(*args, flush=True)


def event_times(cupy, op, repeats, warmup=2):
    """Seconds of ``op()`` per repetition, between CUDA events recorded on the current stream."""
    times = []
    for i in range(warmup + repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        op()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return times


def slowest_times(cupy, op, repeats, warmup=2):
    """Seconds of ``op()`` per repetition, wall clock to a device synchronize, max over ranks."""
    times = []
    for i in range(warmup + repeats):
        cupy.cuda.runtime.deviceSynchronize()
        COMM.Barrier()
        t0 = time.perf_counter()
        op()
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return times


def fmt_ms(times):
    return f"{statistics.median(times) * 1e3:.3f} ms (min {min(times) * 1e3:.3f})"


def kernel_figures(cupy, repeats):
    """scaled_copy vs a device-to-device memcpy of the same 64 MB."""
    from hpcgrad.kernels.cuda import scaled_copy
    n = 64 * MB // 4
    src = cupy.random.random(n, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    scaled_copy(dst, src, 0.5)  # compiled outside the timing
    cupy.cuda.runtime.deviceSynchronize()
    if not bool(cupy.allclose(dst, src * 0.5)):
        raise RuntimeError("scaled_copy gave wrong values on the GPU")
    stream = cupy.cuda.get_current_stream()

    def memcpy():
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    kernel = event_times(cupy, lambda: scaled_copy(dst, src, 0.5), repeats)
    copy = event_times(cupy, memcpy, repeats)
    moved = 2 * src.nbytes  # read + write
    kernel_bw, copy_bw = moved / statistics.median(kernel) / 1e9, moved / statistics.median(copy) / 1e9
    say(f"kernel scaled_copy 64 MB: {kernel_bw:.0f} GB/s ({fmt_ms(kernel)}); device copy "
        f"{copy_bw:.0f} GB/s ({fmt_ms(copy)}); ratio {kernel_bw / copy_bw:.2f} (target >= 0.8)")


def allreduce_figures(cupy, dist, repeats):
    """hpcgrad.distributed.all_reduce of 16 MB of device memory, on the chosen path (and staged)."""
    from hpcgrad.comm import buffers
    size = COMM.Get_size()
    flat = cupy.ones(16 * MB // 4, dtype=cupy.float32)
    factor = 2 * (size - 1) / size if size > 1 else 1.0
    aware = buffers.cuda_aware()
    paths = [("CUDA-aware" if aware else "staged", aware)] + ([("staged", False)] if aware else [])
    for name, value in paths:
        buffers._cuda_aware = value  # the comm layer's decision, forced for the staged figure
        try:
            times = slowest_times(cupy, lambda: dist.all_reduce(flat), repeats)
        finally:
            buffers._cuda_aware = aware
        bw = factor * flat.nbytes / statistics.median(times) / 1e9
        say(f"all-reduce 16 MB at {size} rank(s), {name}: {bw:.2f} GB/s bus bandwidth ({fmt_ms(times)})")


def hpcgrad_ddp_step(cupy, device, batch, repeats):
    from training import CASES, build

    import hpcgrad as hg
    import hpcgrad.nn.functional as F
    from hpcgrad.nn.parallel import DistributedDataParallel
    shape, specs = CASES["MLP 784-1024-1024-10"]
    rng = np.random.default_rng(COMM.Get_rank())
    x = hg.tensor(rng.standard_normal((batch,) + shape).astype(np.float32)).cuda(device)
    y = hg.tensor(rng.integers(0, 10, batch)).cuda(device)
    hg.manual_seed(0)
    model = DistributedDataParallel(build(hg, specs).cuda(device))
    optimizer = hg.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return slowest_times(cupy, step, repeats, warmup=3)


def torch_ddp_step(device, batch, repeats):
    """torch DDP on the same GPU, or (None, why)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None, "torch not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA"
    from training import CASES, build
    size = COMM.Get_size()
    backend = "nccl" if size == 1 else "gloo"  # NCCL refuses two ranks on one GPU
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + COMM.bcast(os.getpid() % 1000, root=0)))
    torch.cuda.set_device(device)
    tdist.init_process_group(backend, rank=COMM.Get_rank(), world_size=size)
    try:
        shape, specs = CASES["MLP 784-1024-1024-10"]
        rng = np.random.default_rng(COMM.Get_rank())
        x = torch.tensor(rng.standard_normal((batch,) + shape).astype(np.float32)).cuda(device)
        y = torch.tensor(rng.integers(0, 10, batch)).cuda(device)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(build(torch, specs).cuda(device),
                                                          device_ids=[device])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize(device)

        times = []
        for i in range(3 + repeats):
            torch.cuda.synchronize(device)
            COMM.Barrier()
            t0 = time.perf_counter()
            step()
            elapsed = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= 3:
                times.append(elapsed)
        return times, backend
    finally:
        tdist.destroy_process_group()


def ddp_figures(cupy, device, batch, repeats):
    ours = hpcgrad_ddp_step(cupy, device, batch, repeats)
    theirs, how = torch_ddp_step(device, batch, repeats)
    line = (f"DDP step MLP 784-1024-1024-10, batch {batch}/rank, {COMM.Get_size()} rank(s): "
            f"hpcgrad {fmt_ms(ours)}")
    if theirs is None:
        line += f"; torch DDP: skipped ({how})"
    else:
        ratio = statistics.median(ours) / statistics.median(theirs)
        line += f"; torch DDP ({how}) {fmt_ms(theirs)}; ratio {ratio:.2f}x (target <= 1.2x)"
    say(line)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=256, help="per rank, DDP step")
    p.add_argument("--quick", action="store_true", help="5 repeats")
    args = p.parse_args()
    repeats = 5 if args.quick else args.repeats
    gpus = COMM.allreduce(gpu_count(), op=MPI.MIN)
    if gpus == 0:
        say("no GPU: cupy is missing or sees no CUDA device; nothing to measure")
        return 0
    import cupy

    import hpcgrad.cuda
    import hpcgrad.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("mpi")
    device = dist.get_local_rank() % gpus  # ranks on a node share its GPUs round-robin
    hpcgrad.cuda.set_device(device)
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    say(f"GPU {name}, {COMM.Get_size()} rank(s), {gpus} GPU(s) per node seen; "
        f"MPI {MPI.Get_library_version().splitlines()[0].strip()}")
    kernel_figures(cupy, repeats)
    allreduce_figures(cupy, dist, repeats)
    ddp_figures(cupy, device, args.batch, repeats)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # training.py beside it
    sys.exit(main())
