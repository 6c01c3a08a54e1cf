"""Training-step time with hpcgrad.nn + optim.SGD, beside PyTorch CPU: an MLP and a small CNN.

    python benchmarks/training.py           # one thread; torch column when torch is installed
    python benchmarks/training.py --quick
    python benchmarks/training.py --rounds 15 --steps 5 --case MLP
    python benchmarks/training.py --cpu-time   # thread CPU time: steadier on a busy machine
    python benchmarks/training.py --keep-freed-memory   # glibc keeps freed pages (mallopt)

Step = forward and cross-entropy, zero_grad, backward, SGD(momentum) step, each phase timed.
hpcgrad and torch run interleaved in the same process: ``--rounds`` rounds of ``--steps`` timed
steps of each (which goes first alternates), so a noisy neighbour slows both alike. Figures:
median (min) ms over all timed steps; ratio = hpcgrad / torch, the median over rounds of the
round's median ratio. See Note [Where the training step goes] in hpcgrad/nn/_functions.py.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import ctypes
import gc
import resource
import statistics
import time

import numpy as np

CASES = {  # name: (input shape without batch, layer specs)
    "MLP 784-1024-1024-10": ((784,), [("linear", 784, 1024), ("relu",), ("linear", 1024, 1024),
                                      ("relu",), ("linear", 1024, 10)]),
    "CNN 1x28x28 (conv8-pool-conv16-pool-fc)": ((1, 28, 28), [
        ("conv", 1, 8), ("relu",), ("pool",), ("conv", 8, 16), ("relu",), ("pool",),
        ("flatten",), ("linear", 16 * 7 * 7, 10)]),
}
PHASES = ("forward", "zero_grad", "backward", "step", "total")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def build(lib, specs):
    """The same architecture in hpcgrad or torch (torch.nn mirrors hpcgrad.nn's names)."""
    nn = lib.nn
    make = {"linear": lambda a, b: nn.Linear(a, b), "relu": nn.ReLU,
            "conv": lambda a, b: nn.Conv2d(a, b, 3, padding=1), "pool": lambda: nn.MaxPool2d(2),
            "flatten": nn.Flatten}
    return nn.Sequential(*[make[s[0]](*s[1:]) for s in specs])


def make_step(lib, shape, specs, batch, clock=time.perf_counter):
    """A function that runs one training step and returns its phase times (seconds)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = rng.integers(0, 10, batch)
    lib.manual_seed(0)
    model = build(lib, specs)
    optimizer = lib.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if lib.__name__ == "torch":
        x, y = lib.from_numpy(x), lib.from_numpy(y)
    else:
        x, y = lib.tensor(x), lib.tensor(y)
    loss_fn = lib.nn.functional.cross_entropy

    def step():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = clock()
        loss = loss_fn(model(x), y)
        t1 = clock()
        optimizer.zero_grad()
        t2 = clock()
        loss.backward()
        t3 = clock()
        optimizer.step()
        t4 = clock()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, faults)

    return step


def interleaved(steps, rounds, per_round, warmup=2):
    """Per library: a list of rounds, each a list of phase-time tuples of its timed steps.

    The cyclic GC is collected before each step and left running in it, as in a user's loop.
    """
    for step in steps:
        for _ in range(warmup):
            step()
    times = [[] for _ in steps]
    for r in range(rounds):
        order = range(len(steps)) if r % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            this_round = []
            for _ in range(per_round):
                gc.collect()
                this_round.append(steps[i]())
            times[i].append(this_round)
    return times


def summarize(times):
    """{phase: (median, min, per-round medians)} of one library's times (seconds)."""
    out = {}
    for k, phase in enumerate(PHASES):
        flat = [t[k] for rnd in times for t in rnd]
        per_round = [statistics.median(t[k] for t in rnd) for rnd in times]
        out[phase] = (statistics.median(flat), min(flat), per_round)
    out["faults"] = statistics.median(t[len(PHASES)] for rnd in times for t in rnd)
    return out


def keep_freed_memory():
    """glibc: serve every array from the heap and never give freed memory back to the kernel,
    so a step reuses pages instead of faulting fresh ones in (both libraries, same process)."""
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, 256 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("mallopt refused M_MMAP_THRESHOLD/M_TRIM_THRESHOLD (not glibc?)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None, help="default 256 (MLP) and 64 (CNN)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=3, help="timed steps per library per round")
    p.add_argument("--case", default=None, help="only cases whose name starts with this")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the thread's CPU clock instead of the wall clock: on a shared, "
                        "oversubscribed machine it leaves out the time the step waited for a core")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc mallopt: no mmap'd arrays and no heap trimming (see "
                        "Note [Where the training step goes]); default: glibc's own policy")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    import hpcgrad
    libs = [hpcgrad]
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(1)
            libs.append(torch)
        except ImportError:
            pass
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"training step, float32, one thread, {len(libs)} libraries interleaved; median (min) "
          f"{'CPU' if args.cpu_time else 'wall'} ms per phase; ratio = hpcgrad / torch (median of "
          "the rounds' median ratios)")
    print(f"{'case':42}{'batch':>6}{'phase':>10}"
          + "".join(f"{lib.__name__:>18}" for lib in libs) + ("   ratio" if len(libs) > 1 else ""))
    for name, (shape, specs) in CASES.items():
        if args.case and not name.startswith(args.case):
            continue
        batch = args.batch or (256 if name.startswith("MLP") else 64)
        rounds, per_round = args.rounds, args.steps
        if args.quick:
            batch, rounds, per_round = 16, 2, 2
        steps = [make_step(lib, shape, specs, batch, clock) for lib in libs]
        stats = [summarize(t) for t in interleaved(steps, rounds, per_round)]
        for k, phase in enumerate(PHASES):
            cells = "".join(f"{s[phase][0] * 1e3:10.2f} ({s[phase][1] * 1e3:5.1f})"
                            for s in stats)
            ratio = ""
            if len(stats) > 1:
                ratios = [a / b for a, b in zip(stats[0][phase][2], stats[1][phase][2])]
                ratio = f"{statistics.median(ratios):8.2f}x"
            label = name if k == 0 else ""
            size = f"{batch:6d}" if k == 0 else " " * 6
            print(f"{label:42}{size}{phase:>10}{cells}{ratio}")
        print(f"{'':48}{'faults':>10}" + "".join(f"{s['faults']:18.0f}" for s in stats)
              + "   (minor page faults per step, median)")


if __name__ == "__main__":
    main()
