"""The differential fuzzer's op families: random programs as data (op specs), and how a spec reads as Python.

A *variant* is a list of op specs ``(op, out, args)``: ``op`` names a line in RENDER, ``out`` is the
variable it assigns (None for a statement), ``args`` are source fragments (variable names, or
``repr`` of literals). RENDER turns a spec into one line of Python in a dialect that hpcgrad and
PyTorch both read: ``T`` is the library, ``F`` its ``nn.functional``, ``nn`` its ``nn``,
``checkpoint`` its ``utils.checkpoint.checkpoint``, and PRELUDE's helpers (``Multi``, ``block``,
``module``, ``finish``) are written once in that dialect. So one variant runs in every hpcgrad
mode and in PyTorch, and prints as a standalone script (tests/fuzz.py).

A *program* is a few variants that differ a little (one or two knobs redrawn: the number of
pieces of a split, the outputs of a custom Function, which outputs are used, the batch size, a
hook present or not, retain_graph, dtype, broadcasting...), run one after another in one process,
so that a cached backward plan is tempted to serve a graph it does not describe (issue 25).
Each family is ``(KNOBS, build)``: KNOBS draws each knob from an RNG, ``build(b, knobs, skip)``
emits the ops into a Builder. ``skip`` names known hpcgrad defects (KNOWN_DEFECTS in fuzz.py) whose
sub-cases are not generated, so a CI budget can pass while they are being fixed.
"""

import numpy as np

PRELUDE = '''\
def npy(t):
    if t is None:
        return None
    try:
        return t.detach().numpy().copy()
    except RuntimeError:  # PyTorch's ZeroTensor (a gradient known to be zero) needs force
        return t.detach().numpy(force=True).copy()


class Multi(Function):
    """n outputs x*w*(i+1); backward averages its outputs' gradients (issue 25's case)."""

    @staticmethod
    def forward(ctx, x, w, n, materialize, none_for_w):
        ctx.set_materialize_grads(materialize)
        ctx.save_for_backward(x, w)
        ctx.n, ctx.none_for_w = n, none_for_w
        return tuple(x * w * (i + 1) for i in range(n))

    @staticmethod
    def backward(ctx, *grads):
        x, w = ctx.saved_tensors
        total = None
        for i, g in enumerate(grads):
            if g is not None:
                total = g * (i + 1) if total is None else total + g * (i + 1)
        if total is None:
            return None, None, None, None, None
        total = total / len(grads)  # as many as forward's outputs (a plan once passed fewer)
        gw = None if ctx.none_for_w else (total * x).sum_to_size(w.shape)
        return total * w, gw, None, None, None


def block(x, w):
    h = T.tanh(x @ w)
    return h * x.sigmoid() + h


def module(m, rng, dtype, leaves, name):
    """Parameters from rng (each library draws its own), recorded as leaves."""
    m = m.double() if dtype == "float64" else m
    for pname, p in m.named_parameters():
        with T.no_grad():
            p.copy_(T.tensor(rng.uniform(-1, 1, tuple(p.shape)).astype(dtype)))
        leaves[name + "." + pname] = p
    return m


def finish(kind, outs, leaves, kept, rng):
    """A weighted sum of the outputs, backward of the given kind; returns what is compared."""
    loss = 0
    for o in outs:
        c = rng.uniform(-1, 1, tuple(o.shape)).astype(npy(o).dtype)
        loss = loss + (o * T.tensor(c)).sum()
    R = {"loss": npy(loss)}
    xs = list(leaves.values())
    if kind == "backward":
        loss.backward()
    elif kind == "twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif kind == "grad":
        for k, g in zip(leaves, T.autograd.grad(loss, xs, allow_unused=True)):
            R["d" + k] = npy(g)
    elif kind == "double":
        gs = T.autograd.grad(loss, xs, create_graph=True, allow_unused=True)
        for k, g in zip(leaves, gs):
            R["d" + k] = npy(g)
        sum((g * g).sum() for g in gs if g is not None).backward()
    for k, v in leaves.items():
        R[k + ".grad"] = npy(v.grad)
    for k, v in kept.items():
        R[k + ".grad"] = npy(v.grad)
    for i, o in enumerate(outs):
        R["out%d" % i] = npy(o)
    return R
'''

RENDER = {
    # inputs and the end
    "seed": "rng = np.random.default_rng({0})",
    "leaf": "{o} = T.tensor(rng.uniform({1}, {2}, {0}).astype({3}), requires_grad=True); leaves[{o!r}] = {o}",
    "const": "{o} = T.tensor(rng.uniform({1}, {2}, {0}).astype({3}))",
    "target": "{o} = T.tensor(rng.integers(0, {1}, {0}))",
    "out": "outs.append({0})",
    "finish": "R = finish({0}, outs, leaves, kept, rng)",
    # elementwise
    "add": "{o} = {0} + {1}", "sub": "{o} = {0} - {1}", "mul": "{o} = {0} * {1}",
    "div": "{o} = {0} / {1}", "pow": "{o} = {0} ** {1}", "neg": "{o} = -{0}",
    "exp": "{o} = T.exp({0})", "log": "{o} = T.log({0})", "sqrt": "{o} = T.sqrt({0})",
    "abs": "{o} = {0}.abs()", "tanh": "{o} = T.tanh({0})", "sigmoid": "{o} = T.sigmoid({0})",
    "relu": "{o} = T.relu({0})", "sin": "{o} = T.sin({0})", "cos": "{o} = {0}.cos()",
    "clamp": "{o} = T.clamp({0}, {1}, {2})", "maximum": "{o} = T.maximum({0}, {1})",
    "where": "{o} = T.where({0} > 0, {1}, {2})", "possq": "{o} = {0} * {0} + 0.5",
    "scale": "{o} = {0} * {1}", "rscale": "{o} = {1} / {0}",
    # reductions
    "sum": "{o} = {0}.sum({1}, keepdim={2})", "sumall": "{o} = {0}.sum()",
    "mean": "{o} = {0}.mean({1}, keepdim={2})", "var": "{o} = {0}.var({1}, keepdim={2})",
    "maxdim": "{o} = {0}.max({1}, keepdim={2})[0]", "maxall": "{o} = {0}.max()",
    "amax": "{o} = {0}.amax({1})",
    # matmul
    "matmul": "{o} = {0} @ {1}", "linear": "{o} = F.linear({0}, {1}, {2})",
    # shape ops and views
    "reshape": "{o} = {0}.reshape({1})", "view": "{o} = {0}.view({1})",
    "transpose": "{o} = {0}.transpose({1}, {2})", "t": "{o} = {0}.t()",
    "permute": "{o} = {0}.permute({1})", "flatten": "{o} = {0}.flatten({1})",
    "unsqueeze": "{o} = {0}.unsqueeze({1})", "squeeze": "{o} = {0}.squeeze({1})",
    "expand": "{o} = {0}.expand({1})", "index": "{o} = {0}[{1}]",
    "narrow": "{o} = {0}.narrow({1}, {2}, {3})", "select": "{o} = {0}.select({1}, {2})",
    "cat": "{o} = T.cat([{0}, {1}], {2})", "stack": "{o} = T.stack([{0}, {1}], {2})",
    "contiguous": "{o} = {0}.contiguous()", "clone": "{o} = {0}.clone()",
    # multi-output ops and custom Functions
    "chunk": "{o} = list({0}.chunk({1}, {2}))", "split": "{o} = list({0}.split({1}, {2}))",
    "unbind": "{o} = list({0}.unbind({1}))", "item": "{o} = {0}[{1}]",
    "multi": "{o} = list(Multi.apply({0}, {1}, {2}, {3}, {4}))",
    # in place
    "add_": "{0}.add_({1})", "sub_": "{0}.sub_({1})", "mul_": "{0}.mul_({1})",
    "div_": "{0}.div_({1})", "exp_": "{0}.exp_()", "tanh_": "{0}.tanh_()",
    "sigmoid_": "{0}.sigmoid_()", "relu_": "{0}.relu_()", "clamp_": "{0}.clamp_({1}, {2})",
    "setitem": "{0}[{1}] = {2}", "copy_": "{0}.copy_({1})",
    # hooks
    "hook": "{0}.register_hook(lambda g: g * {1})", "hookm": "{0}.register_hook(lambda g: g.{1}())",
    "unrequire": "{0}.requires_grad_(False)", "retain": "{0}.retain_grad(); kept[{0!r}] = {0}",
    # checkpoints
    "ckpt": "{o} = checkpoint(block, {0}, {1}, use_reentrant={2})",
    # nn
    "module": "{o} = module(nn.{0}, rng, {1}, leaves, {o!r})", "call": "{o} = {0}({1})",
    "conv2d": "{o} = F.conv2d({0}, {1}, {2}, stride={3}, padding={4})",
    "batch_norm": "{o} = F.batch_norm({0}, None, None, {1}, {2}, training=True)",
    "cross_entropy": "{o} = F.cross_entropy({0}, {1})", "mse_loss": "{o} = F.mse_loss({0}, {1})",
    "frelu": "{o} = F.relu({0})",
    # residual blocks' tails (Note [Folded in-place ops])
    "frelu_": "F.relu({0}, inplace=True)", "relu_module": "nn.ReLU(inplace=True)({0})",
    "iadd": "{0} += {1}", "add_alpha": "{0}.add_({1}, alpha={2})",
    "batch_norm_eval": "{o} = F.batch_norm({0}, {1}, {2}, {3}, {4}, training=False)",
    "sdpa": "{o} = F.scaled_dot_product_attention({0}, {1}, {2}, is_causal={3}, scale={4})",
}


class V(str):
    """A variable name among a spec's args (anything else is a literal, written with repr)."""


def render(spec):
    op, out, args = spec
    return RENDER[op].format(*args, o=out)


class Builder:
    """Collects one variant's specs; tracks each variable's shape (a list for multi-output ops)."""

    def __init__(self, seed, dtype):
        self.ops, self.shapes, self.n, self.dtype = [], {}, 0, dtype
        self.emit("seed", None, int(seed))

    def emit(self, op, shape, *args, name=None):
        out = None
        if shape is not None:
            self.n += 1
            out = V(name or f"v{self.n}")
            self.shapes[out] = shape
        self.ops.append((op, out, tuple(str(a) if isinstance(a, V) else repr(a) for a in args)))
        return out

    def leaf(self, shape, lo=-1.0, hi=1.0):
        return self.emit("leaf", tuple(shape), tuple(shape), lo, hi, self.dtype, name=f"x{self.n + 1}")

    def const(self, shape, lo=-1.0, hi=1.0):
        return self.emit("const", tuple(shape), tuple(shape), lo, hi, self.dtype)

    def shape(self, v):
        return self.shapes[v]

    def dummy(self, v):
        return np.zeros(self.shapes[v])


def choice(rng, seq):
    return seq[int(rng.integers(len(seq)))]


BACKWARDS = ("backward", "backward", "twice", "grad", "double")

COMMON_KNOBS = {
    "dtype": lambda r: choice(r, ("float64", "float64", "float32")),
    "backward": lambda r: choice(r, BACKWARDS),
    "n": lambda r: int(r.integers(1, 4)),  # batch size
    "struct": lambda r: int(r.integers(1 << 30)),  # the seed of a variant's random structure
}


def _finish(b, knobs, outs):
    for o in outs:
        b.emit("out", None, o)
    b.emit("finish", None, knobs["backward"])


# elementwise ------------------------------------------------------------------------------------

_UNARY = ("exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu", "sin", "cos", "clamp", "neg",
          "pow")
_BINARY = ("add", "sub", "mul", "div", "maximum", "where", "powt")
_SHAPES = (((3,), (3,)), ((2, 3), (3,)), ((2, 1), (1, 3)), ((2, 3), ()), ((2, 3), (2, 3)))


def _bshape(*shapes):
    return np.broadcast_shapes(*shapes)


def _elementwise_op(b, srng, pool):
    """One random elementwise op over the pool's values; returns the new value."""
    a = choice(srng, pool)
    if srng.random() < 0.5:
        op = choice(srng, _UNARY)
        shape = b.shape(a)
        if op in ("log", "sqrt"):
            return b.emit(op, shape, b.emit("possq", shape, a))
        if op == "exp":
            return b.emit("exp", shape, b.emit("tanh", shape, a))
        if op == "clamp":
            return b.emit("clamp", shape, a, round(float(srng.uniform(-0.8, 0)), 2),
                          round(float(srng.uniform(0, 0.8)), 2))
        if op == "pow":
            e = choice(srng, (2, 3, 0.5, -1.0, 1.5))
            base = a if e in (2, 3) else b.emit("possq", shape, a)
            return b.emit("pow", shape, base, e)
        return b.emit(op, shape, a)
    op = choice(srng, _BINARY)
    c = choice(srng, pool)
    shape = tuple(_bshape(b.shape(a), b.shape(c)))
    if op == "div":
        return b.emit("div", shape, a, b.emit("possq", b.shape(c), c))
    if op == "powt":
        return b.emit("pow", shape, b.emit("possq", b.shape(a), a), c)
    if op == "where":
        d = choice(srng, pool)
        shape = tuple(_bshape(shape, b.shape(d)))
        return b.emit("where", shape, d, a, c)
    return b.emit(op, shape, a, c)


ELEMENTWISE_KNOBS = dict(COMMON_KNOBS, shapes=lambda r: int(r.integers(len(_SHAPES))),
                         depth=lambda r: int(r.integers(1, 6)),
                         scalar=lambda r: choice(r, (None, 2.0, 0.5, 3, "t64", "i64")))


def build_elementwise(b, knobs, skip):
    srng = np.random.default_rng(knobs["struct"])
    sa, sc = _SHAPES[knobs["shapes"]]
    n = knobs["n"]
    if len(sa) == 2 and sa[0] == 2:  # the batch size changes the first dim
        sa, sc = (n,) + sa[1:], ((n,) + sc[1:] if len(sc) == 2 else sc)
    pool = [b.leaf(sa), b.leaf(sc)]
    scalar = knobs["scalar"]
    if scalar in ("t64", "i64"):  # a 0-d tensor of another dtype: PyTorch keeps the dimensioned one's
        scalar = _Src("T.tensor(np.float64(2.5))" if scalar == "t64" else "T.tensor(np.int64(3))")
    if scalar is not None:  # a Python number on one side (type promotion keeps the dtype)
        pool.append(b.emit(choice(srng, ("scale", "rscale")), b.shape(pool[0]), pool[0], scalar))
    for _ in range(knobs["depth"]):
        pool.append(_elementwise_op(b, srng, pool))
    outs = [pool[-1]] + ([pool[-2]] if srng.random() < 0.3 else [])
    _finish(b, knobs, outs)


# reductions -------------------------------------------------------------------------------------

REDUCE_KNOBS = dict(COMMON_KNOBS, op=lambda r: choice(r, ("sum", "mean", "var", "maxdim", "amax",
                                                          "sumall", "maxall")),
                    dim=lambda r: int(r.integers(-2, 3)), keepdim=lambda r: bool(r.integers(2)),
                    rank=lambda r: int(r.integers(1, 4)), pre=lambda r: bool(r.integers(2)))


def build_reduce(b, knobs, skip):
    shape = ((knobs["n"], 3, 4)[:knobs["rank"]] if knobs["rank"] > 1 else (4,))
    x = b.leaf(shape)
    if knobs["pre"]:  # a factor in front, so the reduction's gradient is not all ones
        x = b.emit("mul", shape, x, b.leaf(shape[-1:]))
    dim = knobs["dim"] % len(shape) - len(shape) * (knobs["dim"] < 0)
    op = knobs["op"]
    if op in ("sumall", "maxall"):
        y = b.emit(op, ())
    else:
        out = list(shape)
        if knobs["keepdim"] and op != "amax":
            out[dim] = 1
        else:
            del out[dim]
        y = b.emit(op, tuple(out), x, dim, knobs["keepdim"]) if op != "amax" else \
            b.emit("amax", tuple(out), x, dim)
    _finish(b, knobs, [y])


# matmul and Linear ------------------------------------------------------------------------------

MATMUL_KNOBS = dict(COMMON_KNOBS, form=lambda r: choice(r, ("mm", "bmm", "mv", "vm", "vv",
                                                            "linear", "linear3")),
                    k=lambda r: int(r.integers(1, 4)), m=lambda r: int(r.integers(1, 4)),
                    bias=lambda r: bool(r.integers(2)), act=lambda r: bool(r.integers(2)))


def build_matmul(b, knobs, skip):
    n, k, m, form = knobs["n"], knobs["k"], knobs["m"], knobs["form"]
    if form.startswith("linear"):
        x = b.leaf((2, n, k) if form == "linear3" else (n, k))
        w = b.leaf((m, k))
        bias = b.leaf((m,)) if knobs["bias"] else None
        y = b.emit("linear", b.shape(x)[:-1] + (m,), x, w, bias)
    else:
        sa, sb = {"mm": ((n, k), (k, m)), "bmm": ((2, n, k), (k, m)), "mv": ((n, k), (k,)),
                  "vm": ((k,), (k, m)), "vv": ((k,), (k,))}[form]
        x, w = b.leaf(sa), b.leaf(sb)
        y = b.emit("matmul", np.matmul(np.zeros(sa), np.zeros(sb)).shape, x, w)
    if knobs["act"]:
        y = b.emit("relu", b.shape(y), y)
    _finish(b, knobs, [y])


# shape ops and views ----------------------------------------------------------------------------

def _shape_op(b, srng, x, skip):
    """A random shape op or view of x that keeps it non-empty; returns the new value."""
    shape, d = b.shape(x), b.dummy(x)
    nd = len(shape)
    ops = ["reshape", "unsqueeze", "flatten", "index", "clone", "contiguous"]
    if nd >= 1:
        ops += ["narrow", "select"] if nd >= 2 else ["narrow"]
        ops += ["expand"] if 1 in shape else []
    if nd >= 2:
        ops += ["transpose", "permute", "t"] if nd == 2 else ["transpose", "permute"]
    if 1 in shape:
        ops.append("squeeze")
    if nd == 1:
        ops.append("t")  # 1-D t() is a no-op view
    if "clone_strides" not in skip or b.shapes.get(("contig", x), True):
        ops.append("view")
    op = choice(srng, ops)
    contig = True
    if op in ("reshape", "view"):
        new = (-1,) if srng.random() < 0.5 or nd == 0 else (shape[0], -1) if nd >= 1 else (-1,)
        y = b.emit(op, d.reshape(new).shape, x, new)
    elif op == "unsqueeze":
        dim = int(srng.integers(-nd - 1, nd + 1))
        y = b.emit(op, np.expand_dims(d, dim).shape, x, dim)
    elif op == "squeeze":
        dim = choice(srng, [i for i, s in enumerate(shape) if s == 1])
        y = b.emit(op, np.squeeze(d, dim).shape, x, dim)
    elif op == "flatten":
        y = b.emit(op, d.reshape(-1).shape, x, 0)
    elif op == "expand":
        new = tuple(3 if s == 1 else s for s in shape)
        y, contig = b.emit(op, new, x, new), False
    elif op == "transpose":
        i, j = (int(v) for v in srng.choice(nd, 2, replace=False))
        y, contig = b.emit(op, np.swapaxes(d, i, j).shape, x, i, j), False
    elif op == "permute":
        p = tuple(int(v) for v in srng.permutation(nd))
        y, contig = b.emit(op, d.transpose(p).shape, x, p), False
    elif op == "t":
        y, contig = b.emit(op, d.T.shape, x), nd < 2
    elif op == "narrow":
        dim = int(srng.integers(nd))
        if shape[dim] < 2:
            return b.emit("clone", shape, x)
        start = int(srng.integers(shape[dim] - 1))
        length = int(srng.integers(1, shape[dim] - start + 1))
        y, contig = b.emit(op, d.take(range(start, start + length), dim).shape, x, dim, start,
                           length), dim == 0
    elif op == "select":
        dim = int(srng.integers(nd))
        i = int(srng.integers(-shape[dim], shape[dim]))
        y, contig = b.emit(op, np.take(d, i, dim).shape, x, dim, i), dim == 0
    elif op == "index":
        if nd == 0:
            return b.emit("clone", shape, x)
        idx = choice(srng, (slice(1, None), slice(None, None, 2), (Ellipsis, 0), [0, 0], 0,
                            (slice(None), None), _ZERO, slice(None, None, -1)))
        if idx == slice(None, None, -1) and "negative_step" in skip:
            idx = slice(None, None, 2)
        if idx == slice(1, None) and shape[0] < 2:
            idx = slice(None, None, 2)
        y = b.emit(op, d[0 if idx is _ZERO else idx].shape, x, _Idx(idx))
        # contiguous: a copy ([0, 0]), the first dim sliced or selected, a new axis
        contig = isinstance(idx, (list, int)) or idx is _ZERO or idx in (slice(1, None),
                                                                         (slice(None), None))
    elif op == "contiguous":
        y = b.emit(op, shape, x)
        b.shapes[("contig", y)] = True
        return y
    else:  # clone: PyTorch's keeps the strides (preserve_format), so contiguity is inherited
        y = b.emit(op, shape, x)
    b.shapes[("contig", y)] = contig and b.shapes.get(("contig", x), True)
    return y


class _Src:
    """A literal written as given (a constructor call)."""

    def __init__(self, src):
        self.src = src

    def __repr__(self):
        return self.src


_ZERO = _Src("T.tensor(0)")  # a 0-d integer tensor as an index: PyTorch views, as with 0


class _Idx:
    """An index written as Python source ( `x[1:, None]` ), not as repr(slice(...))."""

    def __init__(self, idx):
        self.idx = idx

    def __repr__(self):
        def one(i):
            if isinstance(i, slice):
                return (f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
                        + ("" if i.step is None else f":{i.step}"))
            return "..." if i is Ellipsis else repr(i)  # (_ZERO's repr is its source)
        return ", ".join(one(i) for i in self.idx) if isinstance(self.idx, tuple) else one(self.idx)


SHAPE_KNOBS = dict(COMMON_KNOBS, depth=lambda r: int(r.integers(1, 5)),
                   rank=lambda r: int(r.integers(1, 4)), join=lambda r: choice(r, (None, "cat", "stack")))


def build_shape(b, knobs, skip):
    srng = np.random.default_rng(knobs["struct"])
    shape = ((knobs["n"], 3, 2)[:knobs["rank"]] if knobs["rank"] > 1 else (3,))
    x = b.leaf(shape)
    y = x
    for _ in range(knobs["depth"]):
        if np.prod(b.shape(y)) == 0:
            break
        y = _shape_op(b, srng, y, skip)
    if knobs["join"] is not None:
        z = b.emit("mul", b.shape(y), y, b.leaf(b.shape(y)))
        dim = int(srng.integers(0, len(b.shape(y)) + 1))
        if knobs["join"] == "cat":
            if len(b.shape(y)) == 0:
                y = b.emit("stack", (2,), y, z, 0)
            else:
                dim = min(dim, len(b.shape(y)) - 1)
                y = b.emit("cat", np.concatenate([b.dummy(y)] * 2, dim).shape, y, z, dim)
        else:
            y = b.emit("stack", np.stack([b.dummy(y)] * 2, dim).shape, y, z, dim)
    _finish(b, knobs, [b.emit("mul", b.shape(y), y, 1.5)])


# multi-output ops and custom Functions ----------------------------------------------------------

def _used(r):
    """Which outputs are used (bit i: output i); the first two often, so that graphs with more
    outputs look the same from the root."""
    return choice(r, (3, 3, 1, 2, 7, int(r.integers(1, 16))))


MULTI_KNOBS = dict(COMMON_KNOBS, op=lambda r: choice(r, ("chunk", "split", "splitlist", "unbind")),
                   pieces=lambda r: int(r.integers(1, 5)), dim=lambda r: int(r.integers(2)),
                   used=_used, rejoin=lambda r: bool(r.integers(2)))


def build_multi(b, knobs, skip):
    size = 6
    shape = (size, knobs["n"]) if knobs["dim"] == 0 else (knobs["n"], size)
    dim = knobs["dim"]
    x = b.leaf(shape)
    h = b.emit("mul", shape, x, b.leaf(shape))
    op, k = knobs["op"], knobs["pieces"]
    d = b.dummy(h)
    if op == "chunk":
        c = -(-size // k)  # PyTorch's chunk: pieces of ceil(size / k), fewer pieces if that covers it
        sizes = [min(c, size - i) for i in range(0, size, c)]
        pieces = b.emit("chunk", [None] * len(sizes), h, k, dim)
    elif op == "split":
        sizes = [min(k, size - i) for i in range(0, size, k)]
        pieces = b.emit("split", [None] * len(sizes), h, k, dim)
    elif op == "splitlist":
        cut = sorted({int(v) for v in np.random.default_rng(k).integers(0, size + 1, 2)})
        sizes = [cut[0], cut[-1] - cut[0], size - cut[-1]][:3]
        pieces = b.emit("split", [None] * len(sizes), h, sizes, dim)
    else:
        sizes = [None] * shape[dim]
        pieces = b.emit("unbind", [None] * len(sizes), h, dim)
    outs = []
    for i, s in enumerate(sizes):
        if not (knobs["used"] >> (i % 4)) & 1:
            continue  # an unused piece
        pshape = np.take(d, 0, dim).shape if s is None else \
            np.take(d, range(s), dim).shape
        p = b.emit("item", pshape, pieces, i)
        outs.append(b.emit("tanh", pshape, p) if i % 2 else p)
    if knobs["rejoin"] and len(outs) >= 2 and sizes[0] is not None:
        outs = [b.emit("cat", np.concatenate([b.dummy(outs[0]), b.dummy(outs[1])], dim).shape,
                       outs[0], outs[1], dim)] + outs[2:]
    if not outs:
        outs = [b.emit("sumall", (), h)]
    _finish(b, knobs, outs)


FUNCTION_KNOBS = dict(COMMON_KNOBS, outputs=lambda r: int(r.integers(1, 5)), used=_used,
                      materialize=lambda r: bool(r.integers(2)),
                      none_for_w=lambda r: bool(r.integers(2)), wshape=lambda r: bool(r.integers(2)),
                      chain=lambda r: bool(r.integers(2)))


def build_function(b, knobs, skip):
    shape = (knobs["n"], 3)
    x = b.leaf(shape)
    w = b.leaf((3,) if knobs["wshape"] else shape)
    h = b.emit("tanh", shape, x) if knobs["chain"] else x
    k = knobs["outputs"]
    ys = b.emit("multi", [shape] * k, h, w, k, knobs["materialize"], knobs["none_for_w"])
    outs = [b.emit("item", shape, ys, i) for i in range(k) if (knobs["used"] >> i) & 1]
    if not outs:
        outs = [b.emit("item", shape, ys, k - 1)]
    _finish(b, knobs, outs)


# in-place ops on non-leaf tensors and on views --------------------------------------------------

INPLACE_KNOBS = dict(COMMON_KNOBS, op=lambda r: choice(r, ("add_", "sub_", "mul_", "div_", "exp_",
                                                           "tanh_", "sigmoid_", "relu_", "clamp_",
                                                           "setitem", "copy_")),
                     target=lambda r: choice(r, ("base", "row", "cols", "t", "view", "unsqueeze",
                                                 "leaf", "saved", "chain", "chain")),
                     use_view=lambda r: bool(r.integers(2)), tensor_arg=lambda r: bool(r.integers(2)))


def build_inplace(b, knobs, skip):
    n = knobs["n"]
    shape = (n, 3)
    x = b.leaf(shape)
    y = b.emit("mul", shape, x, 1.0)  # a non-leaf with x's values
    target = knobs["target"]
    if target == "saved":  # an input that a later op saved, then written: backward must raise
        s = b.emit("sigmoid", shape, y)
        tgt, tshape = s, shape
        outs = [b.emit("mul", shape, s, x)]
    else:
        tgt, tshape = {"base": (y, shape), "leaf": (x, shape)}.get(target, (None, None))
        if tgt is None:
            if target == "row":
                tgt = b.emit("index", (3,), y, _Idx(0))
            elif target == "cols":
                tgt = b.emit("index", (n, 2), y, _Idx((slice(None), slice(1, None))))
            elif target == "t":
                tgt = b.emit("t", (3, n), y)
            elif target == "view":
                tgt = b.emit("view", (3 * n,), y, (-1,))
            elif target == "unsqueeze":
                tgt = b.emit("unsqueeze", (1, n, 3), y, 0)
            else:  # one or two random shape ops or views (tested against PyTorch's view semantics)
                srng = np.random.default_rng(knobs["struct"])
                tgt = y
                for _ in range(int(srng.integers(1, 3))):
                    tgt = _shape_op(b, srng, tgt, skip)
            tshape = b.shape(tgt)
        outs = [y]
    op = knobs["op"]
    other = b.leaf(tshape) if knobs["tensor_arg"] else None
    if op in ("add_", "sub_", "mul_"):
        b.emit(op, None, tgt, other if other is not None else 2.0)
    elif op == "div_":
        b.emit(op, None, tgt, b.emit("possq", tshape, other) if other is not None else 2.0)
    elif op == "clamp_":
        b.emit(op, None, tgt, -0.3, 0.4)
    elif op == "setitem":
        idx = _Idx(0) if len(tshape) else _Idx(Ellipsis)
        val = b.emit("index", tshape[1:], other, idx) if other is not None else 0.5
        b.emit(op, None, tgt, idx, val)
    elif op == "copy_":
        b.emit(op, None, tgt, other if other is not None else b.const(tshape))
    else:
        b.emit(op, None, tgt)
    if knobs["use_view"] and target not in ("base", "leaf", "saved"):
        outs.append(b.emit("mul", tshape, tgt, 3.0))
    _finish(b, knobs, [b.emit("mul", b.shape(o), o, 1.0) for o in outs])


# tensor hooks and retain_grad -------------------------------------------------------------------

HOOKS_KNOBS = dict(COMMON_KNOBS, leaf_hook=lambda r: choice(r, (None, 2.0, 0.5)),
                   mid_hook=lambda r: choice(r, (None, 3.0, -1.0, "sum", "float")),
                   unrequire=lambda r: r.random() < 0.15, retain=lambda r: bool(r.integers(2)),
                   second=lambda r: bool(r.integers(2)), depth=lambda r: int(r.integers(1, 4)))


def build_hooks(b, knobs, skip):
    srng = np.random.default_rng(knobs["struct"])
    shape = (knobs["n"], 3)
    x, w = b.leaf(shape), b.leaf((3,))
    if knobs["leaf_hook"] is not None:
        b.emit("hook", None, x, knobs["leaf_hook"])
    h = b.emit("mul", shape, x, w)
    hook = knobs["mid_hook"]
    if hook in ("sum", "float"):
        b.emit("hookm", None, h, _Src(hook))  # changes the gradient's shape or dtype: PyTorch raises
    elif hook is not None and not isinstance(hook, str):
        b.emit("hook", None, h, hook)
    if knobs["retain"]:
        b.emit("retain", None, h)
    pool = [h, x, w]
    for _ in range(knobs["depth"]):
        pool.append(_elementwise_op(b, srng, pool))
    if knobs["second"]:  # a second hook on the same tensor
        b.emit("hook", None, pool[-1], 0.25)
    if knobs["unrequire"]:  # after forward: PyTorch fills no .grad
        b.emit("unrequire", None, x)
    _finish(b, knobs, [pool[-1]])


# checkpoints ------------------------------------------------------------------------------------

CHECKPOINT_KNOBS = dict(COMMON_KNOBS, reentrant=lambda r: bool(r.integers(2)),
                        twice=lambda r: bool(r.integers(2)), pre=lambda r: bool(r.integers(2)),
                        backward=lambda r: choice(r, ("backward", "backward", "twice", "grad")))


def build_checkpoint(b, knobs, skip):
    shape = (knobs["n"], 3)
    x, w = b.leaf(shape), b.leaf((3, 3))
    h = b.emit("tanh", shape, x) if knobs["pre"] else x
    y = b.emit("ckpt", shape, h, w, knobs["reentrant"])
    if knobs["twice"]:
        y = b.emit("ckpt", shape, y, w, knobs["reentrant"])
    _finish(b, knobs, [y])


# nn layers and losses ---------------------------------------------------------------------------

NN_KNOBS = dict(COMMON_KNOBS, net=lambda r: choice(r, ("linear", "conv", "fconv", "bn", "fbn")),
                loss=lambda r: choice(r, ("ce", "mse", "none")), stride=lambda r: int(r.integers(1, 3)),
                padding=lambda r: int(r.integers(0, 2)), relu=lambda r: bool(r.integers(2)),
                backward=lambda r: choice(r, ("backward", "backward", "twice", "grad")),
                kernel=lambda r: choice(r, (3, 3, 1)),  # 1: strided 1x1 ones are subsampled
                padmode=lambda r: choice(r, ("zeros", "zeros", "reflect", "replicate",
                                             "circular")))  # Conv2d's padding_mode


def build_nn(b, knobs, skip):
    n, dt = knobs["n"], knobs["dtype"]
    if knobs["net"] == "linear":
        x = b.leaf((n, 4))
        m = b.emit("module", (), _Src("Linear(4, 3)"), dt)
        y = b.emit("call", (n, 3), m, x)
    elif knobs["net"] in ("conv", "fconv"):
        x = b.leaf((n, 2, 5, 5))
        s, p, k = knobs["stride"], knobs["padding"], knobs["kernel"]
        o = (5 + 2 * p - k) // s + 1
        if knobs["net"] == "conv":
            m = b.emit("module", (), _Src(f"Conv2d(2, 3, {k}, stride={s}, padding={p}, "
                                          f"padding_mode={knobs['padmode']!r})"), dt)
            y = b.emit("call", (n, 3, o, o), m, x)
        else:
            y = b.emit("conv2d", (n, 3, o, o), x, b.leaf((3, 2, k, k)), b.leaf((3,)), s, p)
    else:
        x = b.leaf((n + 1, 3, 2, 2))  # batch norm over one value per channel is undefined
        if knobs["net"] == "bn":
            m = b.emit("module", (), _Src("BatchNorm2d(3)"), dt)
            y = b.emit("call", b.shape(x), m, x)
        else:
            y = b.emit("batch_norm", b.shape(x), x, b.leaf((3,)), b.leaf((3,)))
    if knobs["relu"]:
        y = b.emit("frelu", b.shape(y), y)
    if knobs["loss"] == "none":
        _finish(b, knobs, [y])
        return
    flat = b.emit("reshape", (b.shape(y)[0], int(np.prod(b.shape(y)[1:]))), y, (b.shape(y)[0], -1))
    if knobs["loss"] == "ce":
        t = b.emit("target", (b.shape(flat)[0],), (b.shape(flat)[0],), b.shape(flat)[1])
        loss = b.emit("cross_entropy", (), flat, t)
    else:
        loss = b.emit("mse_loss", (), flat, b.const(b.shape(flat)))
    _finish(b, knobs, [loss, flat] if knobs["relu"] else [loss])


# attention --------------------------------------------------------------------------------------

ATTENTION_KNOBS = dict(
    COMMON_KNOBS, layout=lambda r: choice(r, ("4d", "3d", "packed")),
    length=lambda r: choice(r, (5, 64, 70, 100)),  # 64 and up: the blocked causal paths
    keys=lambda r: choice(r, (0, 0, 9, -4)),  # keys beyond (or short of) the queries
    heads=lambda r: int(r.integers(1, 4)), embed=lambda r: choice(r, (4, 8, 16)),
    causal=lambda r: bool(r.random() < 0.75), scale=lambda r: choice(r, (None, 0.3)),
    backward=lambda r: choice(r, ("backward", "backward", "twice", "grad")))


def build_attention(b, knobs, skip):
    """scaled_dot_product_attention: (B, H, L, E) or (B, L, E) leaves, or a GPT's heads split
    and transposed out of one (B, L, 3 * H * E) leaf and joined back after."""
    n, h, e, length = knobs["n"], knobs["heads"], knobs["embed"], knobs["length"]
    if knobs["layout"] == "packed":
        x = b.leaf((n, length, 3 * h * e))
        parts = b.emit("split", [(n, length, h * e)] * 3, x, h * e, 2)
        q, k, v = (b.emit("transpose", (n, h, length, e), b.emit(
            "view", (n, length, h, e), b.emit("item", (n, length, h * e), parts, i),
            (n, length, h, e)), 1, 2) for i in range(3))
    else:
        lead = (n, h) if knobs["layout"] == "4d" else (n,)
        source = max(1, length + knobs["keys"])
        q, k, v = b.leaf(lead + (length, e)), b.leaf(lead + (source, e)), \
            b.leaf(lead + (source, e + 1))
    shape = b.shape(q)[:-1] + b.shape(v)[-1:]
    y = b.emit("sdpa", shape, q, k, v, knobs["causal"], knobs["scale"])
    if knobs["layout"] == "packed":
        y = b.emit("reshape", (n, length, h * e), b.emit("transpose", (n, length, h, e), y, 1, 2),
                   (n, length, h * e))
    _finish(b, knobs, [y])


# residual blocks' tails ----------------------------------------------------------------------

RESIDUAL_KNOBS = dict(
    COMMON_KNOBS, norm=lambda r: choice(r, ("module", "module", "functional", "eval")),
    spatial=lambda r: choice(r, ((2, 2), (3, 5), (1, 1), (4, 4))),
    pre=lambda r: bool(r.integers(2)),  # the BatchNorm's input an op's output, not a leaf
    add=lambda r: choice(r, (None, "leaf", "leaf", "const", "transposed", "alpha", "self")),
    relu=lambda r: choice(r, (None, "relu_", "relu_", "frelu_", "relu_module")),
    first=lambda r: choice(r, ("add", "add", "add", "relu")),  # relu then add: both raise
    use=lambda r: choice(r, (None, None, "before", "view", "hook", "retain")),
    after=lambda r: bool(r.random() < 0.2),  # one more in-place add after: raises past a relu
    written=lambda r: bool(r.random() < 0.15))  # the BatchNorm's input written after: raises


def build_residual(b, knobs, skip):
    """``out = bn(x); out += other; out.relu_()`` in the forms a ResNet block writes it, and
    the forms that must not be folded into BatchNorm's Node (the output used before, a hook,
    retain_grad, a view, alpha, the relu first): each library and mode, the same results."""
    n, dt = knobs["n"] + 1, knobs["dtype"]  # batch norm over one value per channel is undefined
    h, w = knobs["spatial"]
    shape = (n, 3, h, w)
    x = b.leaf(shape)
    if knobs["pre"]:
        x = b.emit("mul", shape, x, 1.5)
    if knobs["norm"] == "functional":
        y = b.emit("batch_norm", shape, x, b.leaf((3,)), b.leaf((3,)))
    elif knobs["norm"] == "eval":
        y = b.emit("batch_norm_eval", shape, x, b.const((3,)), b.emit("possq", (3,), b.const((3,))),
                   b.leaf((3,)), b.leaf((3,)))
    else:
        m = b.emit("module", (), _Src("BatchNorm2d(3)"), dt)
        y = b.emit("call", shape, m, x)
    if knobs["written"] and knobs["pre"]:  # what BatchNorm saved, written before any fold
        b.emit("add_", None, x, 1.0)
    outs = []
    use = knobs["use"]
    if use == "before":
        outs.append(b.emit("mul", shape, y, 2.0))
    elif use == "view":
        outs.append(b.emit("mul", (3, h, w), b.emit("index", (3, h, w), y, _Idx(0)), 2.0))
    elif use == "hook":
        b.emit("hook", None, y, 3.0)
    elif use == "retain":
        b.emit("retain", None, y)

    def add():
        kind = knobs["add"]
        if kind is None:
            return
        if kind == "const":
            b.emit("iadd", None, y, b.const(shape))
        elif kind == "transposed":  # a non-contiguous residual
            b.emit("iadd", None, y, b.emit("transpose", shape, b.leaf((n, 3, w, h)), 2, 3))
        elif kind == "alpha":
            b.emit("add_alpha", None, y, b.leaf(shape), 2.0)
        elif kind == "self":
            b.emit("iadd", None, y, y)
        else:
            b.emit("add_", None, y, b.emit("mul", shape, b.leaf(shape), 0.5))

    def relu():
        kind = knobs["relu"]
        if kind is not None:
            b.emit(kind, None, y)

    for step in ((add, relu) if knobs["first"] == "add" else (relu, add)):
        step()
    if knobs["after"]:
        b.emit("add_", None, y, 0.25)
    _finish(b, knobs, [y] + outs)


# (knobs, build, hot knobs): half of the changes between variants redraw a hot knob, one that
# changes a graph only a little (the count of a Node's inputs or outputs, which are used, a shape).
FAMILIES = {
    "elementwise": (ELEMENTWISE_KNOBS, build_elementwise, ("n", "shapes", "scalar", "backward")),
    "reduce": (REDUCE_KNOBS, build_reduce, ("dim", "keepdim", "n", "op")),
    "matmul": (MATMUL_KNOBS, build_matmul, ("n", "k", "bias", "form")),
    "shape": (SHAPE_KNOBS, build_shape, ("n", "rank", "join")),
    "multi": (MULTI_KNOBS, build_multi, ("pieces", "used", "op", "n")),
    "function": (FUNCTION_KNOBS, build_function, ("outputs", "used", "materialize", "none_for_w")),
    "inplace": (INPLACE_KNOBS, build_inplace, ("op", "target", "use_view", "n")),
    "hooks": (HOOKS_KNOBS, build_hooks, ("leaf_hook", "mid_hook", "retain", "second", "backward")),
    "checkpoint": (CHECKPOINT_KNOBS, build_checkpoint, ("reentrant", "twice", "n", "backward")),
    "nn": (NN_KNOBS, build_nn, ("n", "loss", "relu", "stride", "padding", "kernel", "padmode")),
    "attention": (ATTENTION_KNOBS, build_attention, ("n", "length", "keys", "causal", "layout")),
    "residual": (RESIDUAL_KNOBS, build_residual, ("add", "relu", "use", "first", "n")),
}


def generate(family, rng, skip=frozenset(), variants=None):
    """A program: a list of variants (each a list of specs) of one family, each a small change of
    the one before (one or two knobs redrawn; the data seed always changes)."""
    knobs_of, build, hot = FAMILIES[family]
    count = variants or int(rng.integers(2, 5))
    knobs = {k: draw(rng) for k, draw in knobs_of.items()}
    names = [k for k in knobs_of if k != "struct"]
    program = []
    for i in range(count):
        if i:
            changed = [choice(rng, hot) if rng.random() < 0.5 else choice(rng, names)]
            if rng.random() < 0.3:
                changed.append(choice(rng, names))
            for k in changed:
                knobs[k] = knobs_of[k](rng)
        b = Builder(int(rng.integers(1 << 30)), knobs["dtype"])
        build(b, knobs, skip)
        program.append({"family": family, "knobs": dict(knobs), "ops": b.ops})
    return program
