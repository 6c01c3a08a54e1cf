"""Where a small-channel convolution's time goes, and the layouts tried against it (issue 28).

    python benchmarks/conv_layouts.py            # ResNet-18's 3x3 stride-1 layers at width 16
    python benchmarks/conv_layouts.py --batch 16 --rounds 31
    python benchmarks/conv_layouts.py --direct   # the direct kernel against the columns' forward
    python benchmarks/conv_layouts.py --step --width 16 --batch 32 --rounds 15  # a whole step
    python benchmarks/conv_layouts.py --weight-grad   # the weight gradient: direct and columns
    python benchmarks/conv_layouts.py --strided       # ResNet-18's stride-2 forwards

One thread (OPENBLAS_NUM_THREADS=1, set before numpy loads), float32, medians of interleaved
rounds. Per layer, the forward pass (``hpcgrad/nn/_conv.py``) in parts: the padding copy, the
columns (im2col), the product and the transposed store; the product's GF/s in three layouts
(weight @ columns as built, columns.T @ weight.T on a transposed view, and on a contiguous
copy); the weight gradient's product both ways (g @ columns.T, and (columns @ g.T).T, which
_conv.py uses); and two whole-forward alternatives that avoid the columns: nine products with a shifted
view of the padded input (one per kernel offset, K = channels), and columns taken as whole
shifted rows of a padded grid (longer copies, a wider product). See Note [Convolution columns].
--direct: per 3x3 stride-1 layer of ResNet-18 at widths 16 and 64, the forward through the
columns (``_forward_arrays``' im2col + GEMM), the direct kernel (kernels/direct_conv.py, Note
[Direct convolution], the padding included) and PyTorch's conv2d where it is installed; the
median of each, the range of its rounds, and the ratios' medians. --step: ResNet-18's training
step (benchmarks/models.py) with the direct kernel on and off (HPCGRAD_DIRECT_CONV, switched
between steps of one process) and PyTorch's, interleaved. --weight-grad: per 3x3 stride-1 layer
(and the stem), the weight gradient through columns and a product, and the direct kernel's at
each vector width this CPU has (``weight_grad_stride1``, the padding included). --strided:
ResNet-18's 3x3 stride-2 forwards through columns, through the input's phases
(``conv2d_strided``) and PyTorch's.
"""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # models.py sets these only when it is the script

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from numpy.lib.stride_tricks import as_strided  # noqa: E402

from hpcgrad.base.kernels import direct_conv  # noqa: E402
from hpcgrad.nn import _conv  # noqa: E402

LAYERS = ((16, 32), (32, 16), (64, 8), (128, 4))  # (channels, side) at width 16
WIDE_LAYERS = ((64, 32), (128, 16), (256, 8), (512, 4))  # ... at width 64


def median_ms(fn, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def forward(a, w):
    geo = _conv._Geometry(a.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    return _conv._forward_arrays(a, w, geo).reshape(geo.n, geo.o, geo.ho, geo.wo)


def shifted_products(a, w, block=4096):
    """Nine products of (O, C) with a shifted view of the input padded as (C, N*Hp*Wp)."""
    n, c, h, width = a.shape
    o = w.shape[0]
    hp, wp = h + 2, width + 2
    padded = np.zeros((c, n, hp, wp), a.dtype)
    padded[:, :, 1:h + 1, 1:width + 1] = a.transpose(1, 0, 2, 3)
    flat = padded.reshape(c, n * hp * wp)
    bases = n * hp * wp - (2 * wp + 2)
    acc = np.empty((o, n * hp * wp), a.dtype)
    offsets = [ky * wp + kx for ky in range(3) for kx in range(3)]
    taps = [np.ascontiguousarray(w[:, :, ky, kx]) for ky in range(3) for kx in range(3)]
    scratch = np.empty((o, block), a.dtype)
    for b0 in range(0, bases, block):
        b1 = min(b0 + block, bases)
        dst = acc[:, b0:b1]
        np.matmul(taps[0], flat[:, b0 + offsets[0]:b1 + offsets[0]], out=dst)
        for tap, off in zip(taps[1:], offsets[1:]):
            part = scratch[:, :b1 - b0]
            np.matmul(tap, flat[:, b0 + off:b1 + off], out=part)
            dst += part
    return np.ascontiguousarray(acc.reshape(o, n, hp, wp)[:, :, :h, :width].transpose(1, 0, 2, 3))


def grid_columns(a, w, chunk=1 << 19):
    """Columns as whole shifted rows of the padded grid: Ho*Wp positions, garbage columns cut."""
    n, c, h, width = a.shape
    o = w.shape[0]
    hp, wp = h + 2, width + 2
    plane, length, rows = hp * wp, h * wp, c * 9
    buf = np.zeros(n * c * plane + 2, a.dtype)  # +2: the last row's reach past its plane
    buf[:n * c * plane].reshape(n, c, hp, wp)[:, :, 1:h + 1, 1:width + 1] = a
    step = max(1, min(n, chunk // (rows * length)))
    out = np.empty((n, o, h, width), a.dtype)
    size = a.itemsize
    space = np.empty(rows * step * length, a.dtype)
    for s in range(0, n, step):
        m = min(step, n - s)
        cols = space[:rows * m * length].reshape(c, 3, 3, m, length)
        cols[...] = as_strided(buf[s * c * plane:], shape=(c, 3, 3, m, length),
                               strides=(plane * size, wp * size, size, c * plane * size, size))
        product = w.reshape(o, rows) @ cols.reshape(rows, m * length)
        out[s:s + m] = product.reshape(o, m, h, wp)[:, :, :, :width].transpose(1, 0, 2, 3)
    return out


def columns_forward(a, w):
    """The columns' path alone (the direct kernel off), as _conv.py ran before it."""
    geo = _conv._Geometry(a.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
    return _conv._columns_forward(a, w, geo).reshape(geo.n, geo.o, geo.ho, geo.wo)


def direct_forward(a, w):
    return direct_conv.conv2d_stride1(_conv._padded(a, (1, 1, 1, 1)), w)


def compare_direct(args):
    """--direct: the columns' forward, the direct kernel and PyTorch, interleaved."""
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(f"3x3 stride-1 forward, batch {args.batch}, float32, one thread; medians [ranges] of "
          f"{args.rounds} interleaved rounds (ms)")
    for channels, side in LAYERS + WIDE_LAYERS:
        a = rng.standard_normal((args.batch, channels, side, side)).astype(np.float32)
        w = (rng.standard_normal((channels, channels, 3, 3)) * 0.1).astype(np.float32)
        timed = {"columns": lambda: columns_forward(a, w)}
        if direct_conv.whole_rows(side, a.dtype):  # else a scalar loop: nn/_conv.py never asks
            np.testing.assert_allclose(direct_forward(a, w), columns_forward(a, w), rtol=1e-4,
                                       atol=1e-4)
            timed["direct"] = lambda: direct_forward(a, w)
        if torch is not None:
            ta, tw = torch.from_numpy(a), torch.from_numpy(w)
            timed["torch"] = lambda: torch.nn.functional.conv2d(ta, tw, padding=1)
        times = {name: [] for name in timed}
        for fn in timed.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in timed.items():
                times[name].append(median_ms(fn, 1))
        gflop = 2 * args.batch * channels * channels * 9 * side * side / 1e9
        line = f"{channels:>4} ch {side:>2}x{side:<2} |"
        for name, t in times.items():
            line += (f" {name} {np.median(t):6.2f} [{min(t):.2f}-{max(t):.2f}] "
                     f"({gflop / np.median(t) * 1e3:.0f} GF/s) |")
        if "direct" not in times:
            print(line + " direct: not taken (rows shorter than a vector)", flush=True)
            continue
        ratio = np.median(np.array(times["direct"]) / np.array(times["columns"]))
        line += f" direct/columns {ratio:.2f}x"
        if torch is not None:
            ratio = np.median(np.array(times["direct"]) / np.array(times["torch"]))
            line += f", direct/torch {ratio:.2f}x"
        print(line, flush=True)


def _interleaved(timed, rounds):
    """{name: [ms per round]} of the callables in ``timed``, one call each per round."""
    times = {name: [] for name in timed}
    for fn in timed.values():
        fn()
    for _ in range(rounds):
        for name, fn in timed.items():
            times[name].append(median_ms(fn, 1))
    return times


def _report(label, times, gflop, reference):
    line = f"{label} |"
    for name, t in times.items():
        line += f" {name} {np.median(t):6.2f} ({gflop / np.median(t) * 1e3:.0f} GF/s) |"
    for name, t in times.items():
        if name != reference:
            line += f" {name}/{reference} {np.median(np.array(t) / np.array(times[reference])):.2f}x"
    print(line, flush=True)


def compare_weight_grad(args):
    """--weight-grad: the weight gradient through columns and the direct kernel, interleaved."""
    rng = np.random.default_rng(0)
    print(f"3x3 stride-1 weight gradient, batch {args.batch}, float32, one thread; medians of "
          f"{args.rounds} interleaved rounds (ms)")
    for channels, side in ((3, 32),) + LAYERS[:3] + WIDE_LAYERS[:2]:
        out_channels = 16 if channels == 3 else channels
        a = rng.standard_normal((args.batch, channels, side, side)).astype(np.float32)
        w = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
        g = rng.standard_normal((args.batch, out_channels, side, side)).astype(np.float32)
        geo = _conv._Geometry(a.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)

        def columns():
            saved = _conv._DIRECT_WEIGHT_GRAD_CHANNELS
            _conv._DIRECT_WEIGHT_GRAD_CHANNELS = {256: 0, 512: 0}
            try:
                return _conv._backward_arrays(a, w, g, geo, False, True)[1]
            finally:
                _conv._DIRECT_WEIGHT_GRAD_CHANNELS = saved
        timed = {"columns": columns}
        for bits in direct_conv.WIDTHS:
            if side % (bits // 32) == 0:
                timed[f"direct{bits}"] = lambda bits=bits: direct_conv.weight_grad_stride1(
                    np.ascontiguousarray(_conv._padded(a, (1, 1, 1, 1))), g, (3, 3), bits=bits)
        gflop = 2 * args.batch * channels * out_channels * 9 * side * side / 1e9
        _report(f"{channels:>4} ch {side:>2}x{side:<2}", _interleaved(timed, args.rounds), gflop,
                "columns")


def compare_strided(args):
    """--strided: ResNet-18's 3x3 stride-2 forwards: columns, the input's phases, PyTorch."""
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(f"3x3 stride-2 forward, batch {args.batch}, float32, one thread; medians of "
          f"{args.rounds} interleaved rounds (ms)")
    for channels, side in ((16, 32), (32, 16), (64, 32)):
        a = rng.standard_normal((args.batch, channels, side, side)).astype(np.float32)
        w = rng.standard_normal((2 * channels, channels, 3, 3)).astype(np.float32)
        geo = _conv._Geometry(a.shape, w.shape, (2, 2), (1, 1, 1, 1), (1, 1), 1)
        timed = {"columns": lambda: _conv._columns_forward(a, w, geo),
                 "phases": lambda: direct_conv.conv2d_strided(a, w, (2, 2), (1, 1, 1, 1))}
        if torch is not None:
            ta, tw = torch.from_numpy(a), torch.from_numpy(w)
            timed["torch"] = lambda: torch.nn.functional.conv2d(ta, tw, stride=2, padding=1)
        gflop = 2 * args.batch * channels * 2 * channels * 9 * geo.positions / 1e9
        _report(f"{channels:>3} -> {2 * channels:<3} {side:>2}x{side:<2}",
                _interleaved(timed, args.rounds), gflop, "columns")


def compare_step(args):
    """--step: ResNet-18's step with the direct kernel on, off, and PyTorch's, interleaved."""
    import statistics
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models  # benchmarks/models.py

    setup = argparse.Namespace(model="resnet18", width=args.width, batch=args.batch, block=128)
    runs = {"on": "1", "off": "0"}
    steps = {name: models.make_step(models.library("hpcgrad"), setup)[0] for name in runs}
    try:
        steps["torch"] = models.make_step(models.library("torch"), setup)[0]
    except ImportError:
        pass
    times = {name: [] for name in steps}
    for _ in range(2 + args.rounds):  # two warm-up rounds, then interleaved
        for name, step in steps.items():
            os.environ["HPCGRAD_DIRECT_CONV"] = runs.get(name, "1")
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    os.environ.pop("HPCGRAD_DIRECT_CONV")
    times = {name: t[2:] for name, t in times.items()}
    print(f"ResNet-18 width {args.width}, batch {args.batch}, one thread; medians [ranges] of "
          f"{args.rounds} interleaved rounds (ms)")
    print("  " + "; ".join(f"{name} {1e3 * statistics.median(t):.1f} [{1e3 * min(t):.1f}-"
                           f"{1e3 * max(t):.1f}]" for name, t in times.items()))
    pairs = [("on", "off")] + ([("on", "torch"), ("off", "torch")] if "torch" in times else [])
    print("  " + "; ".join(
        f"{a}/{b} {statistics.median(x / y for x, y in zip(times[a], times[b])):.2f}x"
        for a, b in pairs))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--direct", action="store_true",
                        help="the direct kernel against the columns' forward and PyTorch")
    parser.add_argument("--step", action="store_true",
                        help="ResNet-18's step, the direct kernel on and off, and PyTorch's")
    parser.add_argument("--width", type=int, default=16, help="--step: the first stage's width")
    parser.add_argument("--weight-grad", action="store_true",
                        help="the weight gradient: the direct kernel against the columns")
    parser.add_argument("--strided", action="store_true",
                        help="stride-2 forwards: the input's phases against the columns")
    args = parser.parse_args(argv)
    if args.direct:
        return compare_direct(args)
    if args.weight_grad:
        return compare_weight_grad(args)
    if args.strided:
        return compare_strided(args)
    if args.step:
        return compare_step(args)
    rng = np.random.default_rng(0)
    print(f"3x3 stride-1 convolutions, batch {args.batch}, float32, one thread; medians of "
          f"{args.rounds} rounds (ms)")
    print(f"{'C=O':>4} {'side':>4} | {'pad':>5} {'im2col':>6} {'GEMM':>6} {'store':>5} "
          f"{'fwd':>6} | GF/s: {'W@cols':>6} {'view':>5} {'copy':>5} {'g@c.T':>6} "
          f"{'(c@g.T).T':>9} | {'shifted':>7} {'grid':>6}")
    for channels, side in LAYERS:
        a = rng.standard_normal((args.batch, channels, side, side)).astype(np.float32)
        w = rng.standard_normal((channels, channels, 3, 3)).astype(np.float32)
        want = forward(a, w)
        for alternative in (shifted_products, grid_columns):
            np.testing.assert_allclose(alternative(a, w), want, rtol=1e-4, atol=1e-3)
        geo = _conv._Geometry(a.shape, w.shape, (1, 1), (1, 1, 1, 1), (1, 1), 1)
        source, loops = _conv._unfold_source(a, geo)
        chunks = list(geo.chunks())
        cols = [geo.columns(source, s, e, 0, loops).copy() for s, e in chunks]
        w2 = w.reshape(channels, -1)
        products = [w2 @ c for c in cols]
        out = np.empty((geo.n, geo.o, geo.positions), np.float32)

        def store():
            for (s, e), p in zip(chunks, products):
                out[s:e] = p.reshape(channels, e - s, geo.positions).transpose(1, 0, 2)

        def unfold():
            for s, e in chunks:
                geo.columns(source, s, e, 0, loops)

        grads = [rng.standard_normal((channels, c.shape[1])).astype(np.float32) for c in cols]
        whole = np.concatenate(cols, axis=1)
        whole_t, w_t = np.ascontiguousarray(whole.T), np.ascontiguousarray(w2.T)
        timed = {
            "pad": lambda: _conv._unfold_source(a, geo), "im2col": unfold,
            "gemm": lambda: [w2 @ c for c in cols], "store": store,
            "fwd": lambda: forward(a, w), "W@cols": lambda: w2 @ whole,
            "view": lambda: whole.T @ w_t, "copy": lambda: whole_t @ w_t,
            "g@c.T": lambda: [g @ c.T for g, c in zip(grads, cols)],
            "(c@g.T).T": lambda: [(c @ g.T).T for g, c in zip(grads, cols)],
            "shifted": lambda: shifted_products(a, w), "grid": lambda: grid_columns(a, w),
        }
        times = {name: [] for name in timed}
        for _ in range(args.rounds):  # interleaved: the machine's drift hits every variant
            for name, fn in timed.items():
                times[name].append(median_ms(fn, 1))
        ms = {name: float(np.median(t)) for name, t in times.items()}
        gflop = 2 * channels * whole.shape[0] * whole.shape[1] / 1e9
        rate = {name: gflop / (ms[name] * 1e-3)
                for name in ("W@cols", "view", "copy", "g@c.T", "(c@g.T).T")}
        print(f"{channels:>4} {side:>4} | {ms['pad']:5.2f} {ms['im2col']:6.2f} {ms['gemm']:6.2f} "
              f"{ms['store']:5.2f} {ms['fwd']:6.2f} | {rate['W@cols']:>12.0f} "
              f"{rate['view']:>5.0f} {rate['copy']:>5.0f} {rate['g@c.T']:>6.0f} "
              f"{rate['(c@g.T).T']:>9.0f} | {ms['shifted']:7.2f} "
              f"{ms['grid']:6.2f}")


if __name__ == "__main__":
    main()
