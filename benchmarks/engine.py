"""Local autograd engine benchmark: hpcgrad against PyTorch CPU (when installed), one thread.

1. Backward cost per Node: a chain of N tiny ops (alternating ``y * c`` and ``y + d`` with constant
   tensors that do not require grad), for tensors of size 1 and 1,000 (float32). Only
   ``s.backward()`` is timed, with ``s = y.sum()`` built fresh, untimed, for every repetition;
   we divide by the number of Nodes in the graph (N ops + SumBackward + AccumulateGrad of x).
   The chain is far deeper than Python's recursion limit: the engine must be iterative.
2. One training step of a 784-1024-1024-10 MLP (``x @ W + b``, relu, log_softmax, NLL loss by
   indexing), batch 256, float32: forward, backward, and an SGD update by hand
   (``p.data -= lr * p.grad.data; p.grad = None``), the same code for both libraries.

Usage:
    /work/venv/bin/python benchmarks/engine.py                 # full run (about a minute)
    /work/venv/bin/python benchmarks/engine.py --quick         # small sizes, a few seconds
    /work/venv/bin/python benchmarks/engine.py --json out.json # also write machine-readable results
    /work/venv/bin/python benchmarks/engine.py --json          # JSON on stdout instead of the table
    /work/venv/bin/python benchmarks/engine.py --instructions  # callgrind instruction counts
                                                          # (--quick: 2,000 ops, MLP 784-128)

Figures are medians of ``--repeats`` runs after a warm-up (min beside them); the machine is noisy.
``--instructions`` counts instructions instead (``valgrind --tool=callgrind``, deterministic and
unmoved by other load): each child does its setup and warm-up, then runs the measured part inside
functools.reduce, the one function callgrind collects in (--toggle-collect); the count is divided
by the Nodes (or ops, or steps) it ran. Cyclic GC is off in the children.
"""

import os

# One thread, everywhere. Must happen before numpy (OpenBLAS) or torch (OpenMP/MKL) is imported.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _name in THREAD_ENV:
    os.environ[_name] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpcgrad as hg  # noqa: E402

try:
    from ._timing import measure, measure_phases
except ImportError:  # run as a script: benchmarks/ is on sys.path
    from _timing import measure, measure_phases

try:
    if "--no-torch" in sys.argv[1:]:
        raise ImportError  # a callgrind child of hpcgrad: importing torch would cost it minutes
    import torch
except ImportError:  # the torch column is simply left out
    torch = None

LIBS = ("hpcgrad", "torch")
# The chain is also run with the plan off: "general" is hpcgrad's general engine (Note
# [Replayed backward plans]); "hpcgrad" replays a plan, built in the warm-up.
GENERAL = "general"


def _hpcgrad_lib(lib):
    """Whether ``lib`` is one of hpcgrad's variants; sets the backward plan mode it asks for."""
    if lib not in ("hpcgrad", GENERAL):
        return False
    hg.autograd.set_backward_plan("off" if lib == GENERAL else "on")
    return True
CHAIN_SIZES = (1, 1000)


# --- 1. backward of a long chain ----------------------------------------------------------------

def count_nodes_hpcgrad(root):
    """Nodes reachable from ``root`` (iteratively: the graph is deeper than the recursion limit)."""
    seen, stack = {id(root)}, [root]
    while stack:
        for edge in stack.pop().next_edges:
            if edge is not None and id(edge.node) not in seen:
                seen.add(id(edge.node))
                stack.append(edge.node)
    return len(seen)


def count_nodes_torch(root):
    seen, stack = {id(root)}, [root]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                stack.append(node)
    return len(seen)


def chain_hpcgrad(size, n_ops):
    rng = np.random.default_rng(0)
    x = hg.tensor(rng.standard_normal(size).astype(np.float32), requires_grad=True)
    c = hg.tensor(np.full(size, 1.0001, np.float32))
    d = hg.tensor(np.full(size, 1e-4, np.float32))

    def build():
        x.grad = None
        y = x
        for i in range(n_ops):
            y = y * c if i % 2 == 0 else y + d
        return y.sum()

    return build, count_nodes_hpcgrad, lambda s: s.grad_fn, lambda: x.grad.data


def chain_torch(size, n_ops):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(size).astype(np.float32)).requires_grad_()
    c = torch.full((size,), 1.0001, dtype=torch.float32)
    d = torch.full((size,), 1e-4, dtype=torch.float32)

    def build():
        x.grad = None
        y = x
        for i in range(n_ops):
            y = y * c if i % 2 == 0 else y + d
        return y.sum()

    return build, count_nodes_torch, lambda s: s.grad_fn, lambda: x.grad.numpy()


def bench_chain(lib, size, n_ops, repeats, warmup, pause_gc=True):
    ours = _hpcgrad_lib(lib)
    build, count, grad_fn, x_grad = (chain_hpcgrad if ours else chain_torch)(size, n_ops)
    probe = build()
    nodes = count(grad_fn(probe))
    del probe
    # Two warm-ups at least: the plan is built at the second backward of a structure.
    stats = measure(lambda s: s.backward(), setup=build, repeats=repeats,
                    warmup=max(warmup, 2) if lib == "hpcgrad" else warmup, pause_gc=pause_gc)
    return {"size": size, "ops": n_ops, "nodes": nodes,
            "backward_ms": stats.as_dict(1e3),
            "us_per_node": stats.as_dict(1e6 / nodes),
            "x_grad_0": float(x_grad()[0])}


# --- 2. MLP training step -----------------------------------------------------------------------

def mlp_init(widths, batch, seed=0):
    """Weights (He-scaled), biases, inputs and labels as numpy arrays, shared by both libraries."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        params += [w, np.zeros(fan_out, np.float32)]
    x = rng.standard_normal((batch, widths[0])).astype(np.float32)
    labels = rng.integers(0, widths[-1], batch).astype(np.int64)
    return params, x, labels


def mlp_step_factory(lib, init, lr):
    arrays, x_np, labels_np = init
    if lib == "hpcgrad":
        params = [hg.tensor(a.copy(), requires_grad=True) for a in arrays]
        x, labels, rows = hg.tensor(x_np.copy()), labels_np.copy(), np.arange(len(labels_np))
    else:
        params = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
        x, labels = torch.from_numpy(x_np.copy()), torch.from_numpy(labels_np.copy())
        rows = torch.arange(len(labels_np))
    losses = []

    # The same code for both libraries from here on.
    def step(clock):
        h = x
        for i in range(0, len(params), 2):
            h = h @ params[i] + params[i + 1]
            if i + 2 < len(params):
                h = h.relu()
        logp = h.log_softmax(1)
        loss = -logp[rows, labels].mean()
        clock.lap("forward")
        loss.backward()
        clock.lap("backward")
        for p in params:
            p.data -= lr * p.grad.data
            p.grad = None
        clock.lap("update")
        losses.append(float(loss.item()))

    return step, losses


def bench_mlp(lib, init, repeats, warmup, lr=0.01, pause_gc=True):
    step, losses = mlp_step_factory(lib, init, lr)
    phases = measure_phases(step, repeats=repeats, warmup=warmup, pause_gc=pause_gc)
    out = {name: stats.as_dict(1e3) for name, stats in phases.items()}
    out["first_loss"], out["last_loss"] = losses[0], losses[-1]
    return out


# --- instruction counts (callgrind) -------------------------------------------------------------

def _measured(run):
    """Run ``run()`` inside functools.reduce: the one C function callgrind collects in
    (``--toggle-collect=functools_reduce``), so a count covers exactly the measured part."""
    functools.reduce(lambda _, __: run(), [0, 1])


def callgrind_child(lib, what, size, n_ops, reps, part):
    """What one callgrind child runs: setup and warm-up, then ``reps`` times ``part``, measured.

    ``what`` is "chain" (``part``: "forward" builds the chain, "backward" runs backward on
    chains built before, unmeasured) or "mlp" (``size`` is the hidden width, ``n_ops`` the
    batch; ``part`` "step").
    """
    if lib == "torch":
        torch.set_num_threads(1)
    ours = _hpcgrad_lib(lib)
    gc.disable()  # as in a backward (Note [Backward and the cyclic GC]): no collection inside
    if what == "chain":
        build = (chain_hpcgrad if ours else chain_torch)(size, n_ops)[0]
        for _ in range(2):  # the second backward builds the plan (when it is on)
            s = build()
            s.backward()
            del s
        if part == "forward":
            _measured(lambda: [build() for _ in range(reps)])
        else:
            roots = [build() for _ in range(reps)]
            _measured(lambda: [s.backward() for s in roots])
    else:
        step, _ = mlp_step_factory(lib, mlp_init([784, size, size, 10], n_ops), 0.01)

        class _NoClock:
            def lap(self, name):
                pass

        for _ in range(2):
            step(_NoClock())
        _measured(lambda: [step(_NoClock()) for _ in range(reps)])


def count_instructions(lib, what, size, n_ops, reps, part):
    """Instructions callgrind collects in the measured part of a ``callgrind_child``."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
           "--toggle-collect=functools_reduce", sys.executable,
           os.path.abspath(__file__), "--callgrind-child", lib, what, str(size), str(n_ops),
           str(reps), part] + (["--no-torch"] if lib != "torch" else [])
    if shutil.which("setarch"):  # no address randomization: id()-keyed dicts hash alike each run
        cmd = ["setarch", platform.machine(), "-R"] + cmd
    env = dict(os.environ, PYTHONHASHSEED="0")  # same dict layouts, same counts, run after run
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, check=False)
    for line in out.stderr.splitlines():
        if "Collected :" in line:
            return int(line.split(":")[-1])
    raise RuntimeError(f"callgrind gave no count (exit {out.returncode}):\n{out.stderr[-2000:]}")


def instruction_report(args, libs):
    """Instructions per backward Node, per forward op and per MLP step, beside PyTorch's."""
    from concurrent.futures import ThreadPoolExecutor
    reps = 2
    jobs = {}
    chain_libs = libs[:1] + [GENERAL] + libs[1:]
    for lib in chain_libs:
        for size in CHAIN_SIZES:
            for part in ("forward", "backward"):
                jobs[(lib, "chain", size, part)] = (lib, "chain", size, args.nodes, reps, part)
    for lib in libs:
        jobs[(lib, "mlp", args.hidden, "step")] = (lib, "mlp", args.hidden, args.batch, reps,
                                                   "step")
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count_instructions(*job), jobs.values())))
    res = {"reps": reps, "nodes_per_chain": args.nodes + 2, "chain": [], "mlp": {},
           "chain_libs": chain_libs}
    for size in CHAIN_SIZES:
        row = {"size": size}
        for lib in chain_libs:
            row[lib] = {"backward_per_node": counts[(lib, "chain", size, "backward")]
                        / (reps * (args.nodes + 2)),
                        "forward_per_op": counts[(lib, "chain", size, "forward")]
                        / (reps * args.nodes)}
        res["chain"].append(row)
    for lib in libs:
        res["mlp"][lib] = counts[(lib, "mlp", args.hidden, "step")] / reps
    return res


def print_instructions(res, args, libs):
    print(f"Instructions (valgrind --tool=callgrind, PYTHONHASHSEED=0, setarch -R), collected "
          f"only in the measured part, {res['reps']} repetitions each")
    print(f"1. chain of {args.nodes:,} ops (y*c, y+d), {res['nodes_per_chain']:,} Nodes: "
          f"backward per Node, forward per op (the chain's build, with .sum())")
    print("   (hpcgrad: replayed plan; general: hpcgrad with the plan off; ratios to torch)")
    chain_libs = res.get("chain_libs", libs)
    head = f"   {'size':>6}" + "".join(f"  {lib + ' bwd/Node':>17}" for lib in chain_libs)
    head += f"  {'fwd/op ' + ' '.join(libs):>22}"
    if "torch" in libs:
        head += f"  {'bwd ratio':>9} {'general':>8} {'fwd ratio':>9}"
    print(head)
    for row in res["chain"]:
        line = f"   {row['size']:>6}" + "".join(
            f"  {row[lib]['backward_per_node']:>17,.0f}" for lib in chain_libs)
        line += f"  {' '.join(format(row[lib]['forward_per_op'], ',.0f') for lib in libs):>22}"
        if "torch" in libs:
            h, g, t = row["hpcgrad"], row[GENERAL], row["torch"]
            line += (f"  {h['backward_per_node'] / t['backward_per_node']:>8.2f}x"
                     f" {g['backward_per_node'] / t['backward_per_node']:>7.2f}x"
                     f" {h['forward_per_op'] / t['forward_per_op']:>8.2f}x")
        print(line)
    print(f"2. MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch}: one training step "
          "(forward, backward, SGD by hand)")
    print("   " + ", ".join(f"{lib} {res['mlp'][lib]:,.0f}" for lib in libs)
          + (f"; ratio {res['mlp']['hpcgrad'] / res['mlp']['torch']:.2f}x"
             if "torch" in libs else ""))


# --- reporting ----------------------------------------------------------------------------------

def environment(args, use_torch):
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "hpcgrad": hg.__version__,
        "torch": torch.__version__ if use_torch else None,
        "torch_installed": torch is not None,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "thread_env": {name: os.environ[name] for name in THREAD_ENV},
        "torch_threads": torch.get_num_threads() if use_torch else None,
        "recursion_limit": sys.getrecursionlimit(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "gc_paused_in_timed_region": args.pause_gc,
        "hpcgrad_git": git_state(),
    }
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info["numpy_blas"] = f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # older numpy: not worth failing the benchmark over
        info["numpy_blas"] = None
    return info


def git_state():
    """Commit of the hpcgrad checkout measured, with ``-dirty`` if its tracked files differ."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(hg.__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty", "--abbrev=10"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def fmt(d, digits):
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f})"


def ratio(results, key_fn):
    if "torch" not in results:
        return None
    return key_fn(results["hpcgrad"]) / key_fn(results["torch"])


def print_report(res):
    env = res["environment"]
    libs = [lib for lib in LIBS if lib in res["mlp"]]
    print("hpcgrad local engine benchmark")
    print(f"  one thread: {' '.join(f'{k}={v}' for k, v in env['thread_env'].items())}"
          + (f", torch.set_num_threads(1) -> {env['torch_threads']}" if env["torch"] else ""))
    print(f"  python {env['python']}, numpy {env['numpy']} ({env['numpy_blas']}), "
          f"hpcgrad {env['hpcgrad']} (git {env['hpcgrad_git']}), torch "
          + (env["torch"] or ("skipped (--no-torch)" if env["torch_installed"]
                              else "not installed (column skipped)")))
    print(f"  {env['machine']}, {env['cpus']} CPUs; median of {env['repeats']} runs after "
          f"{env['warmup']} warm-up, min in parentheses; cyclic GC "
          + ("paused in timed regions" if env["gc_paused_in_timed_region"]
             else "left running, as in a training loop (--pause-gc pauses it)"))
    print()

    chain = res["chain"]
    first = chain[0]["hpcgrad"]
    print(f"1. Backward of a chain of {first['ops']:,} ops (y*c, y+d alternating; c, d constants), "
          f"float32")
    print(f"   timed: s.backward() only, s = y.sum() rebuilt untimed each run; "
          f"Python recursion limit {env['recursion_limit']}")
    head = (f"   {'size':>6} {'nodes':>7}  {'hpcgrad us/node':>17} {'hpcgrad ms':>17}"
            f" {'general us/node':>17}")
    if "torch" in libs:
        head += f"  {'torch us/node':>15} {'torch ms':>15}  {'ratio':>7}"
    print(head)
    for row in chain:
        h = row["hpcgrad"]
        line = (f"   {h['size']:>6} {h['nodes']:>7,}  {fmt(h['us_per_node'], 2):>17} "
                f"{fmt(h['backward_ms'], 1):>17} {fmt(row[GENERAL]['us_per_node'], 2):>17}")
        if "torch" in row:
            t = row["torch"]
            line += (f"  {fmt(t['us_per_node'], 3):>15} {fmt(t['backward_ms'], 2):>15}  "
                     f"{row['ratio']:>6.2f}x")
        print(line)
    print()

    mlp = res["mlp"]
    cfg = res["config"]
    print(f"2. MLP {'-'.join(map(str, cfg['widths']))}, batch {cfg['batch']}, float32: "
          f"x@W+b, relu, log_softmax, NLL by indexing; SGD update by hand")
    head = f"   {'phase':<9} {'hpcgrad ms':>17}"
    if "torch" in libs:
        head += f"  {'torch ms':>17}  {'ratio':>7}"
    print(head)
    for phase in ("forward", "backward", "update", "total"):
        line = f"   {phase:<9} {fmt(mlp['hpcgrad'][phase], 2):>17}"
        if "torch" in libs:
            line += f"  {fmt(mlp['torch'][phase], 2):>17}  {mlp['ratio'][phase]:>6.2f}x"
        print(line)
    losses = ", ".join(f"{lib} {mlp[lib]['first_loss']:.5f}" for lib in libs)
    print(f"   loss at the first step (same initial weights and batch): {losses}")
    print()
    if "torch" in libs:
        print("   ratio = hpcgrad / torch, of the medians; general: hpcgrad's queue engine (plan off)")
    print(f"   wall time of this run: {res['wall_s']:.1f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 7; "
                   "--quick: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--nodes", type=int, default=None, help="ops in the chain (default 20000; "
                   "--quick: 2000)")
    p.add_argument("--batch", type=int, default=None, help="MLP batch (default 256; --quick: 32)")
    p.add_argument("--hidden", type=int, default=None, help="MLP hidden width (default 1024; "
                   "--quick: 128)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few seconds")
    p.add_argument("--pause-gc", action="store_true", help="pause Python's cyclic GC in the timed "
                   "regions, as timeit does (by default it runs, as in a user's training loop)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    p.add_argument("--instructions", action="store_true", help="count instructions with "
                   "valgrind --tool=callgrind instead of timing (minutes: use with --quick)")
    p.add_argument("--callgrind-child", nargs=6, metavar=("LIB", "WHAT", "SIZE", "N", "REPS",
                                                          "PART"), help=argparse.SUPPRESS)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write results as JSON to FILE (and print the table), or with no FILE "
                        "print JSON to stdout instead of the table")
    args = p.parse_args(argv)
    for name, low in (("repeats", 1), ("nodes", 1), ("batch", 1), ("hidden", 1), ("warmup", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"--{name} must be at least {low}, got {value}")
    quick = {"repeats": 3, "nodes": 2000, "batch": 32, "hidden": 128}
    full = {"repeats": 7, "nodes": 20000, "batch": 256, "hidden": 1024}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.callgrind_child:
        lib, what, size, n_ops, reps, part = args.callgrind_child
        callgrind_child(lib, what, int(size), int(n_ops), int(reps), part)
        return None
    libs = ["hpcgrad"] + (["torch"] if torch is not None and not args.no_torch else [])
    if args.instructions:
        res = instruction_report(args, libs)
        print_instructions(res, args, libs)
        if args.json:
            with open(args.json if args.json != "-" else "/dev/stdout", "w") as f:
                json.dump(res, f, indent=2)
        return res
    if "torch" in libs:
        torch.set_num_threads(1)
    start = time.perf_counter()
    res = {"environment": environment(args, "torch" in libs),
           "config": {"nodes": args.nodes, "chain_sizes": list(CHAIN_SIZES), "batch": args.batch,
                      "widths": [784, args.hidden, args.hidden, 10], "quick": args.quick}}

    res["chain"] = []
    for size in CHAIN_SIZES:
        row = {lib: bench_chain(lib, size, args.nodes, args.repeats, args.warmup,
                                pause_gc=args.pause_gc) for lib in libs[:1] + [GENERAL] + libs[1:]}
        if "torch" in row:
            row["ratio"] = ratio(row, lambda r: r["us_per_node"]["median"])
        res["chain"].append(row)

    init = mlp_init(res["config"]["widths"], args.batch)
    res["mlp"] = {lib: bench_mlp(lib, init, args.repeats, args.warmup, pause_gc=args.pause_gc)
                  for lib in libs}
    if "torch" in libs:
        res["mlp"]["ratio"] = {phase: ratio(res["mlp"], lambda r, ph=phase: r[ph]["median"])
                               for phase in ("forward", "backward", "update", "total")}
    res["wall_s"] = time.perf_counter() - start

    if args.json == "-":
        json.dump(res, sys.stdout, indent=2)
        print()
        return res
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"   JSON written to {args.json}")
    return res


if __name__ == "__main__":
    main()
