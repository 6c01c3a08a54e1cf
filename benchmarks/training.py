"""Training-step time with hpcgrad.nn + optim.SGD, beside PyTorch CPU: an MLP and a small CNN.

    python benchmarks/training.py           # one thread; torch column when torch is installed
    python benchmarks/training.py --quick

Step = forward, cross-entropy, zero_grad, backward, SGD(momentum) step. Medians (min) of runs.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402

import numpy as np  # noqa: E402

from _timing import measure  # noqa: E402

CASES = {  # name: (input shape without batch, layer specs)
    "MLP 784-1024-1024-10": ((784,), [("linear", 784, 1024), ("relu",), ("linear", 1024, 1024),
                                      ("relu",), ("linear", 1024, 10)]),
    "CNN 1x28x28 (conv8-pool-conv16-pool-fc)": ((1, 28, 28), [
        ("conv", 1, 8), ("relu",), ("pool",), ("conv", 8, 16), ("relu",), ("pool",),
        ("flatten",), ("linear", 16 * 7 * 7, 10)]),
}


def build(lib, specs):
    """The same architecture in hpcgrad or torch (torch.nn mirrors hpcgrad.nn's names)."""
    nn = lib.nn
    make = {"linear": lambda a, b: nn.Linear(a, b), "relu": nn.ReLU,
            "conv": lambda a, b: nn.Conv2d(a, b, 3, padding=1), "pool": lambda: nn.MaxPool2d(2),
            "flatten": nn.Flatten}
    return nn.Sequential(*[make[s[0]](*s[1:]) for s in specs])


def step_time(lib, shape, specs, batch, repeats):
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

    def step(_):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return measure(step, repeats=repeats, warmup=2, pause_gc=False)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None, help="default 256 (MLP) and 64 (CNN)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    import hpcgrad
    libs = [hpcgrad]
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(1)
            libs.append(torch)
        except ImportError:
            pass
    print("training step, float32, one thread; median (min) ms; ratio = hpcgrad / torch")
    print(f"{'case':42}{'batch':>6}" + "".join(f"{lib.__name__:>18}" for lib in libs)
          + ("   ratio" if len(libs) > 1 else ""))
    for name, (shape, specs) in CASES.items():
        batch = args.batch or (256 if name.startswith("MLP") else 64)
        repeats = args.repeats
        if args.quick:
            batch, repeats = 16, 3
        stats = [step_time(lib, shape, specs, batch, repeats) for lib in libs]
        cells = "".join(f"{s.median * 1e3:10.2f} ({s.min * 1e3:5.1f})" for s in stats)
        ratio = f"{stats[0].median / stats[1].median:8.2f}x" if len(stats) > 1 else ""
        print(f"{name:42}{batch:6d}{cells}{ratio}")


if __name__ == "__main__":
    main()
