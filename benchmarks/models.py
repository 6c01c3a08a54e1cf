"""Real model sizes beside PyTorch CPU: a CIFAR-shaped ResNet-18 and a small GPT, one thread.

    python benchmarks/models.py                      # step time (interleaved rounds) and memory
    python benchmarks/models.py --model resnet18 --width 16 --batch 32 --rounds 5
    python benchmarks/models.py --memory-only        # peak memory added by 3 steps, per library
    python benchmarks/models.py --memory-only --cold # ... with each library's one-time set-up
    mpiexec -n 2 python benchmarks/models.py --ddp   # DDP step at 2 ranks beside PyTorch DDP (gloo)
    python benchmarks/models.py --model resnet18 --layers   # each convolution, fwd + bwd
    python benchmarks/models.py --model resnet18 --alternate \
        hpcgrad.nn._conv._CHUNK_POSITIONS=1,2048     # a setting's values, one process
    HPCGRAD_BLAS=numpy python benchmarks/models.py   # hpcgrad's products by numpy's BLAS, not MKL

The same model code runs on both libraries (``nn`` and ``F`` are hpcgrad's or torch's): the step
is forward, loss, zero_grad, backward and the optimizer's step (SGD with momentum for the ResNet,
AdamW for the GPT). Times: hpcgrad and torch alternate, one step each per round, after two
warm-up steps; the ratio is the median of the rounds' ratios (and their middle half, the
first to the third quartile). Memory: each library in a fresh
process, the peak resident set over 3 steps above the built model (what training adds, the
optimizer's state included), after three products for the BLAS and one step of a tiny model of
the same kind (what a library sets up once per process, numba loading its kernels, MKL's code
read in, is not training); the median of --memory-runs (3) processes a library. --ddp (under mpiexec):
each library's model wrapped in its DistributedDataParallel (PyTorch's over gloo), each rank
with its own batch, one thread per rank; a round's time is its slowest rank's. Nothing here is
used by a test assertion. Freed memory: ``import hpcgrad`` makes glibc's malloc keep freed
blocks for the next step (Note [Keeping freed memory]; HPCGRAD_KEEP_FREED_MEMORY=0 not), so
the interleaved steps of both libraries run so, and hpcgrad's memory child;
--keep-freed-memory does it in PyTorch's memory child too. --alternate MODULE.NAME=V1,V2,...: one hpcgrad step per value per
round, the module's setting set to it before the step (the values rotate, so none always runs
first), PyTorch's step beside them: two settings compared in one process on this noisy machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __name__ == "__main__":  # one thread, before numpy loads its BLAS; not for an importer's process
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                  "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402  (after the thread settings)


def basic_block(lib):
    """torchvision's BasicBlock on lib, its forward as written there (ReLU in place, ``+=``)."""
    nn = lib.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x
            out = self.conv1(x)
            out = self.bn1(out)
            out = self.relu(out)
            out = self.conv2(out)
            out = self.bn2(out)
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            out = self.relu(out)
            return out

    return Block


def resnet18(lib, width, classes=10):
    """ResNet-18 for 32x32 images (3x3 stem, no max pool), as torchvision's CIFAR variants."""
    nn, Block = lib.nn, basic_block(lib)
    layers = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
              nn.ReLU(inplace=True)]
    cin = width
    for i, blocks in enumerate((2, 2, 2, 2)):
        cout = width * 2 ** i
        for j in range(blocks):
            layers.append(Block(cin, cout, 2 if (i and not j) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def gpt(lib, vocab=256, d=256, heads=4, layers=4, block=128):
    """A GPT-2-style decoder: pre-LayerNorm blocks, causal attention, GELU MLP, tied head."""
    nn, F = lib.nn, lib.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(d)
            # GPT-2's initialization, as jobs/train_gpt.py: with N(0, 1) embeddings read back
            # through the tied head the loss started at 170 and the softmax was saturated, its
            # gradient 98% zeros and subnormal floats, whose arithmetic slowed both libraries'
            # products (hpcgrad 25%, PyTorch 15%): a measure of subnormals, not of training.
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() >= 2:
                    std = 0.02 / (2 * layers) ** 0.5 \
                        if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(lib.arange(t))
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x) @ self.tok.weight.T

    return GPT()


def library(name):
    if name == "torch":
        import torch
        torch.set_num_threads(1)
        return torch
    import hpcgrad
    return hpcgrad


def data_parallel(lib):
    """lib's DistributedDataParallel, its process group started (PyTorch's over gloo)."""
    if lib.__name__ == "torch":
        import torch.distributed as tdist
        from mpi4py import MPI
        if not tdist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29519")
            tdist.init_process_group("gloo", rank=MPI.COMM_WORLD.Get_rank(),
                                     world_size=MPI.COMM_WORLD.Get_size())
        return lib.nn.parallel.DistributedDataParallel
    from hpcgrad.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


def make_step(lib, args, rank=None):
    """(step function, parameter count) of args.model on lib, data and model built here; with
    ``rank``, the model in lib's DistributedDataParallel and that rank's own batch."""
    lib.manual_seed(0)
    rng = np.random.default_rng(0 if rank is None else 1 + rank)
    F = lib.nn.functional
    wrap = (lambda m: m) if rank is None else data_parallel(lib)
    if args.model == "resnet18":
        model = wrap(resnet18(lib, args.width))
        x = lib.tensor(rng.standard_normal((args.batch, 3, 32, 32)).astype(np.float32))
        y = lib.tensor(rng.integers(0, 10, args.batch))
        opt = lib.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def loss():
            return F.cross_entropy(model(x), y)
    else:
        model = wrap(gpt(lib, d=getattr(args, "d", 256), block=args.block))
        data = rng.integers(0, 256, (args.batch, args.block + 1))
        x, y = lib.tensor(data[:, :-1]), lib.tensor(data[:, 1:])
        opt = lib.optim.AdamW(model.parameters(), lr=3e-4)

        def loss():
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def step():
        value = loss()
        opt.zero_grad()
        value.backward()
        opt.step()
        return value

    return step, sum(p.numel() for p in model.parameters())


def status_mb(field):
    """VmRSS (resident now) or VmHWM (its peak) of this process, in MB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(args):
    """Run in a fresh process: the peak memory 3 steps add to a built model, as JSON.

    A step of a tiny model of the same kind runs first, so what a library sets up once per
    process (numba loading its compiled kernels, a first use of a BLAS) is not counted as
    training; the peak is then reset (writing 5 to /proc/self/clear_refs), so the imports' and
    the build's own peaks do not hide the steps'. The first step's optimizer state is counted.
    ``file_mb``: how much of the resident set that the steps added is pages of files (a
    library's code read in), not memory allocated."""
    lib = library(args.library)
    if args.keep_freed_memory:
        from hpcgrad.base.memory import keep_freed_memory
        keep_freed_memory()
    if not args.cold:
        warm_blas(lib)
        tiny = argparse.Namespace(**{**vars(args), "width": 2, "batch": 2, "block": 8, "d": 8})
        make_step(lib, tiny)[0]()
    step, params = make_step(lib, args)
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")
    before, file_before = status_mb("VmRSS"), status_mb("RssFile")
    for _ in range(3):
        step()
    print(json.dumps({"added_mb": status_mb("VmHWM") - before, "params": params,
                      "file_mb": status_mb("RssFile") - file_before}))


def warm_blas(lib):
    """One product of each transposition large enough for the library's BLAS.

    The tiny model's products are too small for MKL (hpcgrad gives those under 4M multiply-adds
    to numpy), so before this the first real step read ~11 MB of MKL's AVX-512 code in from its
    library and the width-16 ResNet's figure counted it as training (RssFile; PyTorch had read
    its own kernels at the tiny step). The same products run on both libraries; 176 x 176
    floats (124 KB) stay under glibc's 128 KB mmap threshold, so freeing them leaves PyTorch's
    malloc as it was (a freed mapped block would raise that threshold)."""
    a = lib.tensor(np.ones((176, 176), np.float32))
    for x, y in ((a, a), (a, a.T), (a.T, a)):
        x @ y


def memory(args, names):
    """{name: the median child's figures} over args.memory_runs children a library, the
    libraries alternating (one child's peak moved by 10-25% from run to run for PyTorch)."""
    found = {name: [] for name in names}
    for _ in range(args.memory_runs):
        for name in names:
            argv = [sys.executable, __file__, "--memory-child", "--library", name,
                    "--model", args.model, "--width", str(args.width),
                    "--batch", str(args.batch), "--block", str(args.block)]
            argv += ["--cold"] if args.cold else []
            argv += ["--keep-freed-memory"] if args.keep_freed_memory else []
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            found[name].append(json.loads(out.strip().splitlines()[-1]))
    return {name: sorted(runs, key=lambda run: run["added_mb"])[(len(runs) - 1) // 2]
            for name, runs in found.items()}


def alternatives(spec):
    """--alternate's "MODULE.NAME=V1,V2": (module, name, [values]); no spec: None."""
    if not spec:
        return None
    import importlib
    target, _, values = spec.partition("=")
    module_name, _, name = target.rpartition(".")
    if not (module_name and name and values):
        raise SystemExit(f"--alternate: expected MODULE.NAME=V1,V2 (e.g. "
                         f"hpcgrad.nn._conv._CHUNK_POSITIONS=1,2048), got {spec!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"--alternate: {module_name} has no {name}")
    return module, name, [eval(v, {}) for v in values.split(",")]  # literals: 1, 1 << 19, True


def times(args):
    """Interleaved step times (s): {library: [per round]}; under --ddp the slowest rank's.
    With --alternate, hpcgrad's step once per value: {"hpcgrad NAME=V": [...], ...}."""
    comm = None
    if args.ddp:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    rank = comm.Get_rank() if comm is not None else None
    libs = ["hpcgrad"] + ([] if args.no_torch else ["torch"])
    steps = {name: make_step(library(name), args, rank)[0] for name in libs}
    for step in steps.values():
        step(), step()
    runs = [(name, step, None) for name, step in steps.items()]
    alternate = alternatives(getattr(args, "alternate", None))
    if alternate is not None:
        module, attr, values = alternate
        runs = [(f"hpcgrad {attr}={value!r}", steps["hpcgrad"], value) for value in values] + \
            [run for run in runs if run[0] != "hpcgrad"]
    found = {name: [] for name, _, _ in runs}
    for round_ in range(args.rounds):
        turn = round_ % len(runs) if alternate is not None else 0
        for name, step, value in runs[turn:] + runs[:turn]:
            if value is not None:
                setattr(module, attr, value)
            if comm is not None:
                comm.Barrier()
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
            if comm is not None:
                elapsed = comm.allreduce(elapsed, op=MPI.MAX)
            found[name].append(elapsed)
    return found


def conv_layers(width):
    """ResNet-18's distinct convolutions at 32x32: ((cin, cout, size, stride, kernel), count)."""
    shapes = {(3, width, 32, 1, 3): 1}
    cin, size = width, 32
    for i in range(4):
        cout = width * 2 ** i
        stride = 1 if i == 0 else 2
        first = [(cin, cout, size, stride, 3), (cout, cout, size // stride, 1, 3)]
        if stride != 1 or cin != cout:
            first.append((cin, cout, size, stride, 1))  # the shortcut
        for shape in first:
            shapes[shape] = shapes.get(shape, 0) + 1
        shapes[(cout, cout, size // stride, 1, 3)] += 2  # the stage's second block
        cin, size = cout, size // stride
    return shapes


def gemms_alone(x, w, stride, k):
    """hpcgrad's convolution reduced to its three matrix products (forward, weight and input
    gradients) over its chunks of samples, on random columns: the floor under im2col + GEMM."""
    from hpcgrad.nn import _conv
    rng = np.random.default_rng(1)
    pad = k // 2
    geo = _conv._Geometry(x.shape, w.shape, (stride, stride), (pad,) * 4, (1, 1), 1)
    w2, wt = w.reshape(len(w), -1), np.ascontiguousarray(w.reshape(len(w), -1).T)
    pieces = [(rng.standard_normal((geo.rows, (b - a) * geo.positions)).astype(w.dtype),
               rng.standard_normal((geo.o, (b - a) * geo.positions)).astype(w.dtype))
              for a, b in geo.chunks()]

    def run():
        for cols, g in pieces:
            w2 @ cols, g @ cols.T, wt @ g
    return run


def with_col2im(run):
    """``run`` with the input gradient as col2im, the path Note [Input gradient as a
    convolution] replaced at stride 1, for the two to be timed side by side."""
    from hpcgrad.nn import _conv

    def old_path():
        kept = _conv._input_grad_geometry
        _conv._input_grad_geometry = lambda geo: None
        try:
            run()
        finally:
            _conv._input_grad_geometry = kept
    return old_path


def layer_times(args):
    """Each distinct convolution's forward + backward (input and weight gradients), the
    libraries interleaved, and hpcgrad's three matrix products alone: prints ms, the ratios and
    the layer's count in the model."""
    rng = np.random.default_rng(0)
    libs = ["hpcgrad"] + ([] if args.no_torch else ["torch"])
    total = {name: 0.0 for name in libs}
    for (cin, cout, size, stride, k), count in conv_layers(args.width).items():
        x = rng.standard_normal((args.batch, cin, size, size)).astype(np.float32)
        w = (rng.standard_normal((cout, cin, k, k)) * 0.1).astype(np.float32)
        runs = {}
        for name in libs:
            lib = library(name)
            xt = lib.tensor(x, requires_grad=cin != 3)  # the stem's input needs no gradient
            wt = lib.tensor(w, requires_grad=True)
            conv = lib.nn.functional.conv2d

            def run(lib=lib, xt=xt, wt=wt, conv=conv):
                out = conv(xt, wt, stride=stride, padding=k // 2)
                out.backward(lib.ones_like(out))
            runs[name] = run
        runs["GEMMs"] = gemms_alone(x, w, stride, k)
        if args.col2im:
            runs["col2im"] = with_col2im(runs["hpcgrad"])
        found = {name: [] for name in runs}
        for run in runs.values():
            run(), run()
        for _ in range(max(args.rounds, 5)):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                found[name].append(time.perf_counter() - t0)
        line = (f"  {k}x{k} {cin:>4} -> {cout:<4} {size:>2}x{size:<2} stride {stride} (x{count}): "
                f"hpcgrad {1e3 * statistics.median(found['hpcgrad']):6.2f} ms")
        for name in libs:
            total[name] += count * statistics.median(found[name])
        if "torch" in found:
            ratio = statistics.median(a / b for a, b in zip(found["hpcgrad"], found["torch"]))
            floor = statistics.median(a / b for a, b in zip(found["GEMMs"], found["torch"]))
            line += (f"; torch {1e3 * statistics.median(found['torch']):6.2f} ms; {ratio:.2f}x; "
                     f"hpcgrad's GEMMs alone {floor:.2f}x")
        if "col2im" in found:
            old = statistics.median(a / b for a, b in zip(found["hpcgrad"], found["col2im"]))
            line += f"; against col2im's input gradient {old:.2f}x"
        print(line, flush=True)
    print("  all convolutions of one step: " + "; ".join(
        f"{name} {1e3 * t:.1f} ms" for name, t in total.items()), flush=True)


def _middle_half(ratios):
    """The rounds' ratios' middle half (first to third quartile) as " (middle half A-B)", or
    "" for fewer than 4 rounds: how far the noisy machine moved the ratio between rounds."""
    if len(ratios) < 4:
        return ""
    first, _, third = statistics.quantiles(ratios, n=4)
    return f" (rounds' middle half {first:.2f}-{third:.2f})"


def describe(args):
    from hpcgrad.base import blas as chosen
    blas = "; hpcgrad's products by " + ("MKL" if chosen.MKL else "numpy's BLAS")
    if args.model == "resnet18":
        return f"ResNet-18 width {args.width}, batch {args.batch}, 3x32x32, SGD momentum{blas}"
    return f"GPT 4 layers d 256 4 heads, T {args.block}, batch {args.batch}, AdamW{blas}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet18", "gpt", "all"), default="all")
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's first stage width")
    parser.add_argument("--batch", type=int, default=None, help="16 (ResNet) or 8 (GPT)")
    parser.add_argument("--block", type=int, default=128, help="the GPT's sequence length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-runs", type=int, default=3,
                        help="fresh processes a library for the memory figure; the median's")
    parser.add_argument("--cold", action="store_true",
                        help="memory: no tiny model's step first (numba's set-up counted)")
    parser.add_argument("--ddp", action="store_true",
                        help="under mpiexec: the DDP step beside PyTorch DDP (gloo); no memory")
    parser.add_argument("--layers", action="store_true",
                        help="ResNet-18: each distinct convolution's forward + backward instead")
    parser.add_argument("--col2im", action="store_true",
                        help="--layers: also hpcgrad with col2im's input gradient, interleaved")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc keeps freed memory for the next step, for both libraries "
                             "(hpcgrad.base.memory.keep_freed_memory; import hpcgrad does it "
                             "unless HPCGRAD_KEEP_FREED_MEMORY=0, so this adds PyTorch's "
                             "memory process)")
    parser.add_argument("--alternate", metavar="MODULE.NAME=V1,V2",
                        help="hpcgrad's step once per value of a module setting each round")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", default="hpcgrad", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(args)
    if args.keep_freed_memory:  # process-wide: PyTorch's steps in this process too
        from hpcgrad.base.memory import keep_freed_memory
        keep_freed_memory()
    show = print
    if args.ddp:
        from mpi4py import MPI
        args.no_memory, args.memory_only = True, False
        world = MPI.COMM_WORLD
        if world.Get_rank() != 0:
            show = lambda *a, **k: None  # noqa: E731  (one report, rank 0's)
    for model in (("resnet18", "gpt") if args.model == "all" else (args.model,)):
        one = argparse.Namespace(**{**vars(args), "model": model})
        if one.batch is None:
            one.batch = 16 if model == "resnet18" else 8
        where = f"DDP, {world.Get_size()} ranks (torch: gloo), per rank: " if args.ddp else ""
        show(where + describe(one), flush=True)
        if args.layers:
            if model == "resnet18":
                layer_times(one)
            continue
        if not one.memory_only and one.alternate:
            found = times(one)
            for name, runs in found.items():
                line = f"  {name}: {1e3 * statistics.median(runs):.1f} ms"
                if "torch" in found and name != "torch":
                    ratio = statistics.median(a / b for a, b in zip(runs, found["torch"]))
                    line += f"; {ratio:.2f}x torch"
                show(line, flush=True)
        elif not one.memory_only:
            found = times(one)
            ours = statistics.median(found["hpcgrad"])
            line = f"  step: hpcgrad {1e3 * ours:.1f} ms (min {1e3 * min(found['hpcgrad']):.1f})"
            if "torch" in found:
                ratios = [a / b for a, b in zip(found["hpcgrad"], found["torch"])]
                line += (f"; torch {1e3 * statistics.median(found['torch']):.1f} ms; "
                         f"ratio {statistics.median(ratios):.2f}x{_middle_half(ratios)} "
                         f"(target <= 1.0x)")
            show(line, flush=True)
        if not one.no_memory:
            found = memory(one, ["hpcgrad"] + ([] if one.no_torch else ["torch"]))
            ours, theirs = found["hpcgrad"], found.get("torch")
            line = f"  memory added by 3 steps: hpcgrad {ours['added_mb']:.0f} MB"
            if theirs:
                line += (f"; torch {theirs['added_mb']:.0f} MB; ratio "
                         f"{ours['added_mb'] / max(theirs['added_mb'], 1e-9):.2f}x (target <= 1.0x)")
            code = [f"{name} {found['file_mb']:.0f}" for name, found in
                    (("hpcgrad", ours), ("torch", theirs))
                    if found and found["file_mb"] >= 1]
            if code:  # a library's code read in, counted above: say how much
                line += f" (of which code read from libraries, MB: {', '.join(code)})"
            print(line + f" ({ours['params'] / 1e6:.2f} M parameters)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
