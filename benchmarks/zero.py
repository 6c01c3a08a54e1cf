"""ZeroRedundancyOptimizer: optimizer-state bytes per rank against the unsharded optimizer.

    mpiexec -n 1 python benchmarks/zero.py
    mpiexec -n 2 python benchmarks/zero.py
    mpiexec -n 3 python benchmarks/zero.py            # --models mlp big deep, --optimizer adam|sgd
    mpiexec -n 2 python benchmarks/zero.py --time     # also step() times (--repeats N)

For each model (float32): the bytes of every array in the optimizer's state after one step,
unsharded (what every rank holds without ZeRO) and per rank with ZeroRedundancyOptimizer, the
largest rank's share of the unsharded bytes beside the ideal 1/N, and the parameters each rank
owns. ZeRO stage 1 shards whole parameters (PyTorch's greedy partition, largest first), so a
model dominated by a few big matrices cannot split evenly: the largest rank's share shows it.
Counted from the arrays themselves (nbytes), not from the process's resident memory.

--time: the median time of ``step()`` (gradients already in place, one thread per rank; the
ranks start each step together after a barrier), unsharded beside ZeRO with one broadcast per
parameter and with ``parameters_as_bucket_view`` (one per rank); repetitions interleaved.
ZeRO trades 1/N of the update work for broadcasting every parameter each step.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import itertools
import statistics
import time

import numpy as np

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer

MODELS = {
    "mlp": (784, 1024, 1024, 10),  # the project's MLP (1.9 M parameters)
    "big": (784, 4096, 4096, 4096, 10),  # 37.0 M parameters, two 16.8 M matrices
    "deep": (784,) + (1024,) * 9 + (10,),  # 9.2 M parameters, eight equal 1024x1024 matrices
}
OPTIMIZERS = {"adam": (hg.optim.Adam, {"lr": 1e-3}),
              "sgd": (hg.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def mlp(widths):
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def state_bytes(state):
    """Bytes of the arrays in an optimizer's ``state`` (scalars such as Adam's step: 0)."""
    return sum(value.nbytes for entry in state.values() for value in entry.values()
               if hasattr(value, "nbytes"))


def one_step(model, optimizer):
    x = hg.tensor(np.random.default_rng(0).standard_normal((8, model[0].in_features)),
                  dtype=np.float32)
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()


def measure(name, widths, optimizer, group):
    cls, options = OPTIMIZERS[optimizer]
    hg.manual_seed(0)
    model = mlp(widths)
    params = sum(p.numel() for p in model.parameters())
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, group, **options)
    one_step(model, zero)
    mine = state_bytes(zero.state)
    owned = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    del zero
    unsharded = None
    if group.rank() == 0:  # the same optimizer over the whole model, in one process
        plain = cls(model.parameters(), **options)
        one_step(model, plain)
        unsharded = state_bytes(plain.state)
        del plain
    rows = [None] * group.size()
    dist.all_gather_object(rows, (mine, owned), group)
    return {"model": name, "widths": widths, "parameters": params, "unsharded": unsharded,
            "per_rank": [r[0] for r in rows], "owned": [r[1] for r in rows]}


def step_times(widths, optimizer, group, repeats):
    """Median seconds of step() per variant (this rank's), repetitions interleaved."""
    cls, options = OPTIMIZERS[optimizer]
    variants = {}
    for name, make in (("unsharded", lambda ps: cls(ps, **options)),
                       ("zero", lambda ps: ZeroRedundancyOptimizer(ps, cls, group, **options)),
                       ("zero_bucket_view", lambda ps: ZeroRedundancyOptimizer(
                           ps, cls, group, parameters_as_bucket_view=True, **options))):
        hg.manual_seed(0)
        model = mlp(widths)
        optim = make(list(model.parameters()))
        one_step(model, optim)  # creates the state; the gradients stay for the timed steps
        variants[name] = optim
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, optim in variants.items():
            dist.barrier(group)
            t0 = time.perf_counter()
            optim.step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--time", action="store_true", help="also time step()")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    group = dist.init_process_group()
    n = group.size()
    results = [measure(m, MODELS[m], args.optimizer, group) for m in args.models]
    timings = []
    if args.time:
        for m in args.models:
            rows = [None] * n
            dist.all_gather_object(rows, step_times(MODELS[m], args.optimizer, group,
                                                    args.repeats), group)
            timings.append((m, rows))
    if group.rank() != 0:
        return
    print(f"optimizer-state bytes per rank, {args.optimizer}, float32, {n} rank(s)")
    print(f"{'model':<6} {'params':>11} {'unsharded B':>13} {'per rank B (ZeRO)':>36} "
          f"{'max/unsharded':>13} {'ideal':>6}  owned parameters per rank")
    for r in results:
        per_rank = ", ".join(f"{b:,}" for b in r["per_rank"])
        share = max(r["per_rank"]) / r["unsharded"]
        owned = ", ".join(f"{o:,}" for o in r["owned"])
        print(f"{r['model']:<6} {r['parameters']:>11,} {r['unsharded']:>13,} {per_rank:>36} "
              f"{share:>13.3f} {1 / n:>6.3f}  {owned}")
    if timings:
        print(f"\nstep() median ms, slowest rank's median ({args.repeats} interleaved steps)")
        print(f"{'model':<6} {'unsharded':>10} {'zero':>10} {'zero_bucket_view':>17}")
        for m, rows in timings:
            worst = {k: 1e3 * max(r[k] for r in rows) for k in rows[0]}
            print(f"{m:<6} {worst['unsharded']:>10.2f} {worst['zero']:>10.2f} "
                  f"{worst['zero_bucket_view']:>17.2f}")


if __name__ == "__main__":
    main()
