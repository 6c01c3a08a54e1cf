"""What this machine charges a short step that follows a long one: a floor under RPC overhead.

    python benchmarks/cold_steps.py                 # one process, ~20 s
    mpiexec -n 2 python benchmarks/cold_steps.py    # also a 1 MB array from rank 0 to rank 1

A step of a round trip (encode a message, decode it, start a backward pass) that runs right after
milliseconds of other work (a matmul, a wait for a peer) does not run at the speed it has in a
loop of itself. This times one short step, in one process, warm (after the same step) and after
a stretch of other work of each kind below; and, with two ranks, the receive of a 1 MB array
that the sending rank has just computed, by MPI (as hpcgrad's RPC agent receives payloads) and
by a copy into a shared-memory window that the receiver reads in place. The steps:

  hpcgrad encode   ``rpc.message.encode`` of a 256x1024 tensor that requires grad (no copy of
                   its data: the Python work of a message)
  torch add x20    20 additions of two 8-element tensors (PyTorch's C++ dispatch)
  numpy add x20    20 additions of two 8-element arrays

benchmarks/dist_autograd.py's 256x1024 "overhead" is made of such steps, each after a 6-13 ms
matmul or a wait as long, and of three such receives: Note [The distributed-autograd round
trip] in hpcgrad/dist_autograd/engine.py quotes these figures. Medians of --repeats
trials, each one stretch then one timed step (minimum beside).
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # before numpy or torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpcgrad as hg  # noqa: E402
from hpcgrad.distributed.rpc import message  # noqa: E402
from hpcgrad.base.memory import keep_freed_memory  # noqa: E402

try:
    import torch
except ImportError:
    torch = None


def steps():
    """{name: a short step}."""
    x = hg.tensor(np.ones((256, 1024), np.float32), requires_grad=True)
    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    out = {"hpcgrad encode": lambda: message.encode((x, "256x1024"), None),
           "numpy add x20": lambda: [a + b for _ in range(20)]}
    if torch is not None:
        ta, tb = torch.ones(8), torch.ones(8)
        out["torch add x20"] = lambda: [ta + tb for _ in range(20)]
    return out


def spin(seconds):
    """A Python loop for ``seconds``: it touches almost no memory."""
    def run():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return run


def stretches():
    """{name: a stretch of other work}."""
    a = np.ones((256, 1024), np.float32)
    w = np.ones((1024, 1024), np.float32)
    sweep = np.ones(3 << 18, np.float32)  # 3 MB: more than a core's L2
    out = {"none (warm)": None}
    for ms in (0.1, 1, 4, 10):
        out[f"Python loop {ms:g} ms"] = spin(ms * 1e-3)
    out["3 MB sum (~0.2 ms)"] = sweep.sum
    out["256x1024 @ 1024x1024 (~6 ms)"] = lambda: a @ w
    out["sleep 1 ms"] = lambda: time.sleep(1e-3)
    return out


def time_after(step, stretch, repeats):
    times = []
    for _ in range(repeats):
        if stretch is None:
            step()
        else:
            stretch()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def one_process(repeats):
    named = steps()
    rows = {}
    for stretch_name, stretch in stretches().items():
        rows[stretch_name] = {name: time_after(step, stretch, repeats)
                              for name, step in named.items()}
    names = list(named)
    print(f"one short step after a stretch of other work (us, median (min) of {repeats}); "
          f"torch {torch.__version__ if torch else 'not installed'}")
    header = f"{'after':<30}" + "".join(f"{n:>22}" for n in names)
    print(header)
    print("-" * len(header))
    for stretch_name, cells in rows.items():
        print(f"{stretch_name:<30}" + "".join(
            f"{cells[n][0] * 1e6:>13.1f} ({cells[n][1] * 1e6:>5.1f})" for n in names))


def two_ranks(comm, repeats):
    """Rank 1's time to have rank 0's freshly computed 1 MB array, by MPI and in place."""
    from mpi4py import MPI
    rank = comm.Get_rank()
    n = 256 * 1024
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != comm.Get_size():
        if rank == 0:
            print("the two ranks are on different nodes: no shared-memory row")
        node.Free()
        return
    slots = 4  # the sender rotates through them, so no slot is reused while it may be read
    win = MPI.Win.Allocate_shared(slots * n * 4 if rank == 0 else 0, 1, comm=node)
    arena = np.frombuffer(win.Shared_query(0)[0], np.uint8)
    a = np.ones((256, 1024), np.float32)
    w = np.full((1024, 1024), 1e-3, np.float32)
    note = np.zeros(8, np.uint8)
    status = MPI.Status()
    rows = {}
    for mode in ("MPI Recv", "shared window", "MPI Recv", "shared window"):
        comm.Barrier()
        send_t, recv_t = [], []
        for i in range(repeats):
            if rank == 0:
                data = np.tanh(a @ w)  # fresh, as a remote function's result is
                t0 = time.perf_counter()
                if mode == "MPI Recv":
                    requests = [comm.Isend([data, MPI.FLOAT], dest=1, tag=1)]
                else:
                    slot = arena[(i % slots) * n * 4:(i % slots + 1) * n * 4].view(np.float32)
                    np.copyto(slot, data.ravel())
                    requests = []
                requests.append(comm.Isend([note, MPI.BYTE], dest=1, tag=2))
                send_t.append(time.perf_counter() - t0)
                MPI.Request.Waitall(requests)
                comm.Recv([note, MPI.BYTE], source=1, tag=3)
            elif rank == 1:
                while not comm.Iprobe(0, 2, status):
                    os.sched_yield()
                t0 = time.perf_counter()
                comm.Recv([note, MPI.BYTE], source=0, tag=2)
                if mode == "MPI Recv":
                    out = np.empty(n, np.float32)
                    comm.Recv([out, MPI.FLOAT], source=0, tag=1)
                else:
                    out = arena[(i % slots) * n * 4:(i % slots + 1) * n * 4].view(np.float32)
                recv_t.append(time.perf_counter() - t0)
                assert abs(float(out[0]) - float(np.tanh(np.float32(1.024)))) < 1e-4
                comm.Send([note, MPI.BYTE], dest=0, tag=3)
        gathered = comm.gather(send_t if rank == 0 else recv_t, root=0)
        if rank == 0:
            rows.setdefault(mode, []).append((statistics.median(gathered[0]),
                                              statistics.median(gathered[1])))
    win.Free()
    node.Free()
    if rank == 0:
        print(f"\na 1 MB array rank 0 has just computed, to rank 1 (us, median of {repeats}, "
              "two passes)")
        for mode, passes in rows.items():
            cells = ", ".join(f"sender {s * 1e6:.0f} + receiver {r * 1e6:.0f} = "
                              f"{(s + r) * 1e6:.0f}" for s, r in passes)
            print(f"  {mode:<14} {cells}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200, help="trials per cell (default 200)")
    args = p.parse_args(argv)
    keep_freed_memory()  # as benchmarks/dist_autograd.py: no page faults in the receives
    size, rank, comm = 1, 0, None
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        from hpcgrad.comm.mpi import comm_world
        comm = comm_world()
        size, rank = comm.Get_size(), comm.Get_rank()
    if rank == 0:
        one_process(args.repeats)
    if size >= 2:
        comm.Barrier()
        two_ranks(comm, max(args.repeats // 2, 10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
