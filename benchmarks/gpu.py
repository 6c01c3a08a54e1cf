"""GPU figures: divide-and-copy kernel vs device copy, device all-reduce, DDP step beside torch DDP.

    python benchmarks/gpu.py                    # 1 rank
    mpiexec -n 2 python benchmarks/gpu.py       # 2 ranks sharing the GPU(s), local rank -> device
    python benchmarks/gpu.py --quick            # a smoke run
    python benchmarks/gpu.py --cpu --quick      # the same steps on numpy (tests/test_gpu_benchmark.py)

Without a usable GPU (cupy missing or no device) it prints "no GPU: ..." and exits 0, unless
--cpu asks for the dry run: every measurement below on the host (numpy arrays, the numba CPU
kernel, torch DDP with gloo on CPU tensors), so that the script's pieces are exercised where no
GPU is; its figures say nothing about a GPU and its lines say "(CPU dry run)".

kernel: hpcgrad.base.kernels.cuda.scaled_copy on a 64 MB float32 array vs cudaMemcpyAsync
(device to device) of the same bytes; bandwidth = bytes read + written per second, timed with
CUDA events on the current stream; ratio = kernel / copy (target >= 0.8).
all-reduce: a 16 MB cupy array through hpcgrad.distributed.all_reduce, on the path the comm
layer chose (CUDA-aware, or staged through host memory: Note [CUDA-aware decision]); bus
bandwidth = 2 (n - 1) / n * bytes / time (bytes / time at 1 rank). When MPI is CUDA-aware, the
staged path is measured too.
DDP: step of each model of benchmarks/training.py (the MLP, batch 256 per rank, and the CNN,
batch 64 per rank, as there; --batch sets both): forward, cross-entropy, zero_grad, backward,
SGD(momentum) step, beside torch DDP on the same GPU when torch has CUDA (NCCL at 1 rank; gloo
with CUDA tensors at 2, since NCCL refuses two ranks on one GPU). A step is as slow as its
slowest rank: wall clock to a device synchronize, max over ranks; medians (min) of short runs.
Lines starting "kernel", "all-reduce" and "DDP" are what tests/gpu.sh copies into its report.
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


class Device:
    """Where the figures are taken: the rank's GPU (cupy), or the host for the dry run."""

    def __init__(self, cupy=None, index=-1):
        self.cupy, self.index = cupy, index
        self.xp = cupy if cupy is not None else np
        self.label = "" if cupy is not None else " (CPU dry run)"
        self.torch_device = f"cuda:{index}" if cupy is not None else "cpu"

    def synchronize(self):
        if self.cupy is not None:
            self.cupy.cuda.runtime.deviceSynchronize()

    def to(self, x):
        """A Tensor or Module of hpcgrad (or torch) moved to this device."""
        if self.cupy is None:
            return x
        return x.to(self.torch_device) if type(x).__module__.startswith("torch") \
            else x.cuda(self.index)


def event_times(device, op, repeats, warmup=2):
    """Seconds of ``op()`` per repetition: between CUDA events recorded on the current stream,
    or wall clock on the host."""
    times = []
    cupy = device.cupy
    for i in range(warmup + repeats):
        if cupy is None:
            t0 = time.perf_counter()
            op()
            elapsed = time.perf_counter() - t0
        else:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            op()
            end.record()
            end.synchronize()
            elapsed = cupy.cuda.get_elapsed_time(start, end) / 1e3
        if i >= warmup:
            times.append(elapsed)
    return times


def slowest_times(device, op, repeats, warmup=2):
    """Seconds of ``op()`` per repetition, wall clock to a device synchronize, max over ranks."""
    times = []
    for i in range(warmup + repeats):
        device.synchronize()
        COMM.Barrier()
        t0 = time.perf_counter()
        op()
        device.synchronize()
        elapsed = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return times


def fmt_ms(times):
    return f"{statistics.median(times) * 1e3:.3f} ms (min {min(times) * 1e3:.3f})"


def kernel_figures(device, repeats, megabytes):
    """scaled_copy vs a device-to-device memcpy of the same bytes (host: numba vs np.copyto)."""
    if device.cupy is not None:
        from hpcgrad.base.kernels.cuda import scaled_copy
    else:
        from hpcgrad.base.kernels.cpu import scaled_copy
    xp, cupy = device.xp, device.cupy
    n = megabytes * MB // 4
    src = xp.random.random(n).astype(xp.float32)
    dst = xp.empty_like(src)
    scaled_copy(dst, src, 0.5)  # compiled outside the timing
    device.synchronize()
    if not bool(xp.allclose(dst, src * 0.5)):
        raise RuntimeError(f"scaled_copy gave wrong values{device.label}")

    if cupy is not None:
        stream = cupy.cuda.get_current_stream()

        def memcpy():
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    else:
        def memcpy():
            np.copyto(dst, src)

    kernel = event_times(device, lambda: scaled_copy(dst, src, 0.5), repeats)
    copy = event_times(device, memcpy, repeats)
    moved = 2 * src.nbytes  # read + write
    kernel_bw, copy_bw = moved / statistics.median(kernel) / 1e9, moved / statistics.median(copy) / 1e9
    say(f"kernel scaled_copy {megabytes} MB{device.label}: {kernel_bw:.0f} GB/s ({fmt_ms(kernel)}); "
        f"device copy {copy_bw:.0f} GB/s ({fmt_ms(copy)}); ratio {kernel_bw / copy_bw:.2f} "
        f"(target >= 0.8)")
    return kernel_bw / copy_bw


def allreduce_figures(device, dist, repeats, megabytes):
    """hpcgrad.distributed.all_reduce of device memory, on the chosen path (and staged)."""
    from hpcgrad.comm import buffers
    size = COMM.Get_size()
    flat = device.xp.ones(megabytes * MB // 4, dtype=np.float32)
    factor = 2 * (size - 1) / size if size > 1 else 1.0
    if device.cupy is None:
        paths = [("host arrays", None)]
    else:
        aware = buffers.cuda_aware()
        paths = [("CUDA-aware" if aware else "staged", aware)] + ([("staged", False)] if aware else [])
    for name, value in paths:
        saved = buffers._cuda_aware
        if value is not None:
            buffers._cuda_aware = value  # the comm layer's decision, forced for the staged figure
        try:
            times = slowest_times(device, lambda: dist.all_reduce(flat), repeats)
        finally:
            buffers._cuda_aware = saved
        bw = factor * flat.nbytes / statistics.median(times) / 1e9
        say(f"all-reduce {megabytes} MB at {size} rank(s), {name}{device.label}: {bw:.2f} GB/s "
            f"bus bandwidth ({fmt_ms(times)})")


def inputs(case, batch):
    """This rank's batch of ``case`` (host arrays): images or vectors, and class labels."""
    from training import CASES
    shape = CASES[case][0]
    rng = np.random.default_rng(COMM.Get_rank())
    return rng.standard_normal((batch,) + shape).astype(np.float32), rng.integers(0, 10, batch)


def hpcgrad_ddp_times(device, case, batch, repeats):
    """Step times of hpcgrad DDP on ``case`` of benchmarks/training.py."""
    from training import CASES, build

    import hpcgrad as hg
    import hpcgrad.nn.functional as F
    from hpcgrad.nn.parallel import DistributedDataParallel
    x, y = inputs(case, batch)
    x, y = device.to(hg.tensor(x)), device.to(hg.tensor(y))
    hg.manual_seed(0)
    model = DistributedDataParallel(device.to(build(hg, CASES[case][1])))
    optimizer = hg.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return slowest_times(device, step, repeats, warmup=3)


def torch_ddp_times(device, batches, repeats):
    """({case: step times}, backend) of torch DDP on the same device, or (None, why not)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None, "torch not installed"
    size = COMM.Get_size()
    if device.cupy is not None:
        if not torch.cuda.is_available():
            return None, "torch has no CUDA"
        torch.cuda.set_device(device.index)
        backend = "nccl" if size == 1 else "gloo"  # NCCL refuses two ranks on one GPU
    else:
        torch.set_num_threads(1)
        backend = "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + COMM.bcast(os.getpid() % 1000, root=0)))
    tdist.init_process_group(backend, rank=COMM.Get_rank(), world_size=size)
    try:
        return {case: torch_case_times(torch, device, case, batch, repeats)
                for case, batch in batches.items()}, backend
    finally:
        tdist.destroy_process_group()


def torch_case_times(torch, device, case, batch, repeats):
    """Step times of torch DDP on ``case`` (its process group is up)."""
    from training import CASES, build
    gpu = device.cupy is not None
    x, y = inputs(case, batch)
    x, y = device.to(torch.from_numpy(x)), device.to(torch.from_numpy(y))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        device.to(build(torch, CASES[case][1])), device_ids=[device.index] if gpu else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    times = []
    for i in range(3 + repeats):
        if gpu:
            torch.cuda.synchronize(device.index)
        COMM.Barrier()
        t0 = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize(device.index)
        elapsed = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= 3:
            times.append(elapsed)
    return times


def ddp_figures(device, batch, repeats, with_torch=True):
    """One line per model of benchmarks/training.py: hpcgrad DDP's step, torch DDP's, ratio."""
    from training import CASES
    batches = {case: batch or (256 if case.startswith("MLP") else 64) for case in CASES}
    ours = {case: hpcgrad_ddp_times(device, case, b, repeats) for case, b in batches.items()}
    theirs, how = torch_ddp_times(device, batches, repeats) if with_torch else (None, "--no-torch")
    ratios = {}
    for case, b in batches.items():
        line = (f"DDP step {case}, batch {b}/rank, {COMM.Get_size()} rank(s){device.label}: "
                f"hpcgrad {fmt_ms(ours[case])}")
        if theirs is None:
            line += f"; torch DDP: skipped ({how})"
        else:
            ratios[case] = statistics.median(ours[case]) / statistics.median(theirs[case])
            line += (f"; torch DDP ({how}) {fmt_ms(theirs[case])}; ratio {ratios[case]:.2f}x "
                     f"(target <= 1.2x)")
        say(line)
    return ratios


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=None,
                   help="per rank, DDP step (default 256 for the MLP, 64 for the CNN)")
    p.add_argument("--quick", action="store_true", help="5 repeats")
    p.add_argument("--cpu", action="store_true",
                   help="dry run on the host (numpy), to check the script without a GPU")
    p.add_argument("--megabytes", type=int, default=None,
                   help="kernel array (default 64) and all-reduce array (default 16) size")
    p.add_argument("--no-torch", action="store_true", help="leave torch DDP out")
    args = p.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    gpus = COMM.allreduce(gpu_count(), op=MPI.MIN)
    if gpus == 0 and not args.cpu:
        say("no GPU: cupy is missing or sees no CUDA device; nothing to measure "
            "(--cpu: a dry run of the same steps on the host)")
        return 0

    import hpcgrad.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("mpi")
    # Open MPI's version string ends in a NUL byte
    mpi_library = MPI.Get_library_version().strip("\0 \n").splitlines()[0].strip()
    if args.cpu:
        device = Device()
        say(f"CPU dry run (--cpu), {COMM.Get_size()} rank(s); "
            f"MPI {mpi_library}")
    else:
        import cupy

        import hpcgrad.cuda
        index = dist.get_local_rank() % gpus  # ranks on a node share its GPUs round-robin
        hpcgrad.cuda.set_device(index)
        device = Device(cupy, index)
        props = cupy.cuda.runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        say(f"GPU {name}, {COMM.Get_size()} rank(s), {gpus} GPU(s) per node seen; "
            f"MPI {mpi_library}")
    kernel_figures(device, repeats, args.megabytes or 64)
    allreduce_figures(device, dist, repeats, args.megabytes or 16)
    ddp_figures(device, args.batch, repeats, with_torch=not args.no_torch)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # training.py beside it
    sys.exit(main())
