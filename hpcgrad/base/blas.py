"""Matrix products through MKL's cblas where the ``mkl`` extra is installed (on Intel CPUs), else numpy.

Note [MKL for the products]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
numpy's wheels carry OpenBLAS. On an AVX-512 Xeon, one thread, its SGEMM ran the GPT
benchmark's products ((1024, 256) @ (256, 768) and their kin) at 100-110 GF/s where PyTorch's
(MKL) ran them at 106-126, and the products are two thirds of that step. MKL takes the hot
products (``matmul``: Linear and MatMul, the convolution's columns, attention) through
``cblas_?gemm`` by ctypes, from the ``mkl`` wheel (``pip install -e ".[mkl]"``), one thread a
rank (MKL's sequential layer, as one BLAS thread a rank is the MPI rule here): the GPT step
went from 1.18x PyTorch's time to 1.03-1.06x (``python benchmarks/models.py --model gpt
--alternate hpcgrad.base.blas.MKL=False,True``).

Products under ``_MKL_FROM`` multiply-adds (4M) stay numpy's: a ctypes call costs ~15 us, as
much as such a product. A stack (attention's heads) is one MKL call however its batch axes lie:
``?gemm_batch_strided`` where they merge into one stride, else ``?gemm_batch`` over the
matrices' addresses (no copy).

``HPCGRAD_BLAS``: ``auto`` (the default) uses MKL where its library is installed and the CPU
is Intel's, where it was measured faster; on other CPUs (AMD's, where OpenBLAS's steps were
already about PyTorch's) numpy's until measured there. ``mkl`` asks for it anywhere (an error
if absent), ``numpy`` never.

MKL may sum a product's terms in another order than OpenBLAS, so the results may differ in the
last bits; its conditional numerical reproducibility is set to ``AUTO`` with ``STRICT`` (the
same bits from run to run on one CPU, whatever the arrays' alignment), so a checkpoint's resume
and a rerun agree as with OpenBLAS. The differential tests (tests/base/test_blas.py, and the
fuzzer's programs with MKL, tests/autograd/test_fuzz.py) compare it with numpy's products and
PyTorch in CI; ``matmul`` falls back to numpy for whatever it does not take (other dtypes,
cupy, broadcast batch axes, an operand without a unit stride, empty products).
"""

import ctypes
import ctypes.util
import glob
import os
import sys
import warnings

import numpy as np

from hpcgrad.base import config

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
_CBWR_AUTO, _CBWR_STRICT = 2, 0x10000


def _choice():
    value = config.raw("HPCGRAD_BLAS").strip() or "auto"
    if value not in ("auto", "numpy", "mkl"):
        raise ValueError(f"HPCGRAD_BLAS must be 'auto', 'numpy' or 'mkl', got {value!r}")
    return value


def _intel_cpu():
    """True where /proc/cpuinfo names an Intel CPU (the CPUs MKL was measured faster on)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


def _find_mkl():
    """libmkl_rt from the mkl wheel (the environment's lib/; its soname is libmkl_rt.so.2 up to
    MKL 2025, .so.3 from 2026), or the system's; None if absent."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found = glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so.*"))
        if found:  # the newest soname
            return max(found, key=lambda path: [int(part) for part in
                                                 path.rsplit(".so.", 1)[1].split(".")
                                                 if part.isdigit()])
    return ctypes.util.find_library("mkl_rt")


def _load():
    """MKL's cblas gemm functions, sequential and reproducible, or a RuntimeError saying how to
    install it."""
    path = _find_mkl()
    if path is None:
        raise RuntimeError("HPCGRAD_BLAS=mkl but MKL's libmkl_rt was not found: install the mkl "
                           "extra (pip install -e \".[mkl]\") or unset HPCGRAD_BLAS")
    global _LIB
    lib = _LIB = ctypes.CDLL(path)
    if "MKL_THREADING_LAYER" not in os.environ:
        lib.MKL_Set_Threading_Layer(ctypes.c_int(_SEQUENTIAL))
    if lib.MKL_CBWR_Set(ctypes.c_int(_CBWR_AUTO | _CBWR_STRICT)) != 0:  # before any product
        raise RuntimeError(f"MKL ({path}) refused reproducible mode (MKL_CBWR_Set AUTO | "
                           f"STRICT): an MKL older than 2019.3? Unset HPCGRAD_BLAS")
    gemms = {}
    for dtype, name, scalar in ((np.float32, "cblas_sgemm", ctypes.c_float),
                                (np.float64, "cblas_dgemm", ctypes.c_double)):
        fn, batched = getattr(lib, name), getattr(lib, name + "_batch_strided")
        pointers = getattr(lib, name + "_batch")
        fn.restype = batched.restype = pointers.restype = None
        gemms[np.dtype(dtype)] = (fn, batched, pointers, scalar(1.0), scalar(0.0))
    return gemms


def _use_mkl(choice):
    return choice == "mkl" or (choice == "auto" and _intel_cpu() and _find_mkl() is not None)


_GEMMS = None
_LIB = None  # MKL's library, once loaded (its JIT products: jit_product)
# Multiply-adds from which a product goes to MKL: below, numpy's call is as fast or faster (a
# ctypes call and its pointers cost ~15 us; one thread, AVX-512 Xeon: 128^3 took 88 us by MKL,
# 79 by numpy; (128, 128, 256) 148 both; 2^23 and up MKL 0.9x).
_MKL_FROM = 1 << 22
_CHOICE = _choice()  # read once, at import
MKL = _use_mkl(_CHOICE)  # benchmarks and tests may set it to compare


def _gemms():
    """MKL's gemm functions by dtype, loaded at the first product; None (and numpy's products
    from then on) where ``auto`` chose a library that does not load."""
    global _GEMMS, MKL
    if _GEMMS is None:
        try:
            _GEMMS = _load()
        except (OSError, AttributeError, RuntimeError) as error:
            if _CHOICE == "mkl":
                raise
            MKL = False
            warnings.warn(f"HPCGRAD_BLAS=auto: MKL's library did not load ({error}); numpy's "
                          f"BLAS does the products (HPCGRAD_BLAS=numpy silences this)",
                          RuntimeWarning, stacklevel=3)
            return None
    return _GEMMS


def _layout(a):
    """(transposed flag, leading dimension) of the matrices of ``a`` (its last two axes) where
    they have one unit stride, else None."""
    item = a.itemsize
    rows, cols = a.shape[-2:]
    row_stride, col_stride = a.strides[-2:]
    if col_stride == item and row_stride % item == 0 and row_stride >= max(cols, 1) * item:
        return _NO_TRANS, row_stride // item
    if row_stride == item and col_stride % item == 0 and col_stride >= max(rows, 1) * item:
        return _TRANS, col_stride // item
    return None


def _gemm(a, b, out, accumulate=False):
    """out (m, n) C-contiguous = a (m, k) @ b (k, n) through MKL (``accumulate``: out +=, beta
    1); False where it cannot."""
    la, lb = _layout(a), _layout(b)
    gemms = la and lb and _gemms()
    if not gemms:
        return False
    fn, _, _, one, zero = gemms[a.dtype]
    (m, k), n = a.shape, b.shape[1]
    fn(_ROW_MAJOR, la[0], lb[0], m, n, k, one, ctypes.c_void_p(a.ctypes.data), max(1, la[1]),
       ctypes.c_void_p(b.ctypes.data), max(1, lb[1]), one if accumulate else zero,
       ctypes.c_void_p(out.ctypes.data), max(1, n))
    return True


def _gemm_stack(a, b, out):
    """out[i] = a[i] @ b[i] for stacks (batch, m, k) and (batch, k, n) whose matrices lie a
    fixed stride apart, in one MKL call (``?gemm_batch_strided``); False where it cannot."""
    la, lb = _layout(a), _layout(b)
    gemms = la and lb and not (a.strides[0] % a.itemsize or b.strides[0] % b.itemsize) \
        and _gemms()
    if not gemms:
        return False
    _, batched, _, one, zero = gemms[a.dtype]
    (count, m, k), n = a.shape, b.shape[2]
    batched(_ROW_MAJOR, la[0], lb[0], m, n, k, one, ctypes.c_void_p(a.ctypes.data),
            max(1, la[1]), a.strides[0] // a.itemsize, ctypes.c_void_p(b.ctypes.data),
            max(1, lb[1]), b.strides[0] // b.itemsize, zero, ctypes.c_void_p(out.ctypes.data),
            max(1, n), m * n, count)
    return True


def _merged(stack):
    """stack (..., m, k) as (batch, m, k) without a copy, or None where its batch axes do not
    lie one fixed stride apart."""
    batch = [(size, stride) for size, stride in zip(stack.shape[:-2], stack.strides[:-2])
             if size != 1]
    if any(outer != inner * size for (_, outer), (size, inner) in zip(batch, batch[1:])):
        return None
    return stack.reshape((-1,) + stack.shape[-2:])  # a view


def _gemm_pointers(a, b, out):
    """out[i...] = a[i...] @ b[i...] for stacks with the same batch axes at any strides (as
    attention's heads, a transposed view whose batch axes do not merge), in one MKL call
    (``?gemm_batch`` over arrays of pointers) instead of copying the stacks; False where it
    cannot."""
    la, lb = _layout(a), _layout(b)
    gemms = la and lb and not any(stride % a.itemsize for stride in a.strides + b.strides) \
        and _gemms()
    if not gemms:
        return False
    work = [(a, b, out)]
    key = tuple((x.shape, x.strides, x.dtype) for x in work[0])
    groups = _GROUPS.get(key)
    if groups is None:
        groups = _keep(key, _Groups(work, [(la, lb, (_NO_TRANS, out.shape[-1]))]))
    groups.run(gemms[a.dtype], work)
    return True


class _Groups:
    """What one ``?gemm_batch`` call of ``matmul_into`` needs but the operands' addresses, kept
    per shapes, strides and dtypes (Note [Grouped products]): each parameter's array and each
    matrix's offset from its operand's start."""

    def __init__(self, work, layouts):
        groups = len(work)
        rows, counts = [], []
        for triple in work:
            shape = triple[0].shape[:-2]
            grid = np.indices(shape, np.intp).reshape(len(shape), -1) if shape \
                else np.zeros((0, 1), np.intp)
            strides = np.array([x.strides[:-2] for x in triple], np.intp).reshape(3, -1)
            rows.append(strides @ grid)  # (operand, matrix): signed byte offsets
            counts.append(grid.shape[1])
        # as ?gemm_batch reads them: every a, then every b, then every out, group by group
        self.offsets = np.concatenate(rows, axis=1)
        self.where = np.repeat(np.arange(3 * groups).reshape(groups, 3).T, counts, axis=1)
        self.params = np.array(
            [[la[0], lb[0], a.shape[-2], b.shape[-1], a.shape[-1], max(1, la[1]),
              max(1, lb[1]), max(1, lc[1]), count]
             for (a, b, _), (la, lb, lc), count in zip(work, layouts, counts)],
            np.intc).T.copy()  # (9, groups): each parameter's array
        self.groups = groups

    def run(self, gemms, work):
        _, _, pointers, one, zero = gemms
        bases = np.array([x.ctypes.data for triple in work for x in triple], np.intp)
        table = bases[self.where] + self.offsets  # (3, matrices): every matrix's address
        groups = self.groups
        scalars = np.array([[one.value] * groups, [zero.value] * groups],
                           np.float32 if isinstance(one, ctypes.c_float) else np.float64)
        p0, t0, s0 = self.params.ctypes.data, table.ctypes.data, scalars.ctypes.data
        row, third = self.params.itemsize * groups, table.shape[1] * table.itemsize
        param = [ctypes.c_void_p(p0 + i * row) for i in range(9)]
        pointers(_ROW_MAJOR, param[0], param[1], param[2], param[3], param[4],
                 ctypes.c_void_p(s0), ctypes.c_void_p(t0), param[5],
                 ctypes.c_void_p(t0 + third), param[6],
                 ctypes.c_void_p(s0 + scalars.itemsize * groups),
                 ctypes.c_void_p(t0 + 2 * third), param[7], groups, param[8])


_GROUPS = {}  # each operand's (shape, strides, dtype) -> _Groups: a kept key passed the checks
_GROUPS_KEPT = 512


def _keep(key, groups):
    if len(_GROUPS) >= _GROUPS_KEPT:
        _GROUPS.clear()
    _GROUPS[key] = groups
    return groups


def matmul_into(products):
    """``out[...] = a @ b`` for each (a, b, out) of ``products``: stacks with the same batch
    axes at any strides, each matrix (out's too) with one unit stride, so that blocks of larger
    arrays are written in place (blocked causal attention, nn/_causal_attention.py). One MKL
    call for all (``?gemm_batch``, a group per product) where MKL is used and every operand is
    numpy float32/float64 of one dtype; else numpy's ``matmul(a, b, out=out)`` per product.
    Empty products (a zero-sized side) write nothing, or zeros where the sum is empty.

    Note [Grouped products]
    ~~~~~~~~~~~~~~~~~~~~~~~
    A call's Python, not MKL's work, was its cost at attention's sizes: the parameters' arrays
    and every matrix's address took 90-250 us of Python a call where MKL's own set-up took 3,
    and a GPT layer's attention makes six calls a step. What depends only on the operands'
    shapes and strides (the checks, the layouts, each parameter's array, each matrix's offset
    from its operand's start) is kept per those (``_GROUPS``, at most ``_GROUPS_KEPT``
    entries), so a step's call adds the operands' addresses to kept offsets and calls MKL."""
    products = list(products)
    dtype = products[0][0].dtype if products else None
    key = None
    if MKL and dtype in (np.float32, np.float64) \
            and all(type(x) is np.ndarray for triple in products for x in triple):
        key = tuple((x.shape, x.strides, x.dtype) for triple in products for x in triple)
        groups = _GROUPS.get(key)
        if groups is not None:  # kept: these shapes and strides passed every check below
            groups.run(_gemms()[dtype], products)
            return
    work = []
    for a, b, out in products:
        if not (a.shape[:-2] == b.shape[:-2] == out.shape[:-2] and a.shape[-1] == b.shape[-2]
                and out.shape[-2:] == (a.shape[-2], b.shape[-1])):
            raise ValueError(f"matmul_into: {list(a.shape)} @ {list(b.shape)} does not fit "
                             f"an output of {list(out.shape)} (equal batch axes, (m, k) @ "
                             f"(k, n) -> (m, n))")
        if a.shape[-1] == 0:
            out[...] = 0
        elif out.size:
            work.append((a, b, out))
    if not work:
        return
    gemms = key is not None and _gemms()
    layouts = []
    for triple in work if gemms else ():
        layout = [_layout(x) for x in triple]
        if any(x.dtype != dtype for x in triple) or None in layout \
                or layout[2][0] != _NO_TRANS \
                or any(stride % dtype.itemsize for x in triple for stride in x.strides):
            gemms = None
            break
        layouts.append(layout)
    if not gemms:
        for a, b, out in work:
            np.matmul(a, b, out=out)
        return
    groups = _Groups(work, layouts)
    if len(work) == len(products):  # (a call with empty products is not kept: rare)
        _keep(key, groups)
    groups.run(gemms[dtype], work)


def jit_product(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc):
    """MKL's product ``c = a @ b`` compiled for these parameters (row-major, alpha 1, beta 0;
    MKL's flags and leading dimensions as ``cblas_?gemm`` takes them): a ``JitProduct``, or
    None where MKL is not used or refuses the parameters. Where MKL compiles no code of its
    own (larger sizes) the kernel calls its usual gemm.

    Note [MKL's JIT products]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    A product of a few dozen rows costs MKL's ``?gemm`` (and ``?gemm_batch``, per matrix) its
    checks and packing around ~50 us of arithmetic; MKL's JIT compiles a kernel for one
    product's sizes and leading dimensions, called through a function pointer, so a numba loop
    can make many such products between its own passes (causal attention a head at a time,
    kernels/causal_heads.py). The kernel's sums are in an order of its own, so its results
    agree with ``?gemm``'s to rounding; for given parameters it is the same code every call,
    so a run repeats its bits. Compiling one takes ~0.4 ms, so the last ``_JITTED_KEPT`` are
    kept by their parameters; a kernel is freed when nothing holds it (the cache let go of it
    and no kept plan uses it), so a loop running it in another thread keeps it alive."""
    if not (MKL and _gemms()) or np.dtype(dtype) not in (np.float32, np.float64):
        return None
    key = (np.dtype(dtype).char, trans_a, trans_b, m, n, k, lda, ldb, ldc)
    if key in _JITTED:
        return _JITTED[key]
    name, scalar = ("s", ctypes.c_float) if key[0] == "f" else ("d", ctypes.c_double)
    create = getattr(_LIB, f"mkl_cblas_jit_create_{name}gemm")
    pointer = getattr(_LIB, f"mkl_jit_get_{name}gemm_ptr")
    create.restype, pointer.restype, pointer.argtypes = ctypes.c_int, ctypes.c_void_p, \
        [ctypes.c_void_p]
    jitter = ctypes.c_void_p()
    status = create(ctypes.byref(jitter), _ROW_MAJOR, trans_a, trans_b, m, n, k, scalar(1.0),
                    lda, ldb, scalar(0.0), ldc)
    made = JitProduct(pointer(jitter), jitter.value, _LIB.mkl_jit_destroy) \
        if status in _JIT_MADE and jitter.value else None
    if len(_JITTED) >= _JITTED_KEPT:
        _JITTED.clear()
    _JITTED[key] = made
    return made


class JitProduct:
    """One kernel ``jit_product`` made: ``kernel(jitter, a, b, c)`` at these two addresses
    (kernels/jit_products.py ``call``), freed by MKL with this object."""

    __slots__ = ("kernel", "jitter", "_destroy")

    def __init__(self, kernel, jitter, destroy):
        self.kernel, self.jitter, self._destroy = kernel, jitter, destroy

    def __del__(self):
        if self.jitter:
            self._destroy(ctypes.c_void_p(self.jitter))
            self.jitter = 0


_JIT_MADE = (0, 1)  # MKL_JIT_SUCCESS, MKL_NO_JIT (its usual gemm behind the pointer)
_JITTED = {}  # jit_product's parameters -> JitProduct (or None where MKL refused)
_JITTED_KEPT = 1024


def addmm(bias, x, y):
    """``x @ y + bias`` of 2-D x and y and a bias broadcast along the rows. Where ``matmul``
    would use MKL and the bias is (n,) of their dtype, the bias is written into the output and
    the product added onto it in the same call (beta 1, as PyTorch's addmm): one pass over the
    output fewer, Linear's forward on the GPT's shapes 0.93-0.99x PyTorch's time where the
    product and then the add took 1.00-1.04x. Its sums start from the bias instead of adding
    it last, so the two agree to rounding, not to the bit (MKL's blocks over k add into the
    output). Elsewhere the product, then the bias added in place."""
    if _takes(x, y) and x.ndim == 2 and y.ndim == 2 and type(bias) is np.ndarray \
            and bias.dtype == x.dtype and bias.shape == (y.shape[1],):
        out = np.empty((x.shape[0], y.shape[1]), x.dtype)
        out[...] = bias
        if _gemm(x, y, out, accumulate=True):
            return out
    out = matmul(x, y)
    out += bias
    return out


def _takes(x, y):
    """Whether ``matmul`` sends ``x @ y`` to MKL (its conditions, the MKL call's own aside)."""
    return MKL and type(x) is np.ndarray and type(y) is np.ndarray \
        and x.dtype == y.dtype and x.dtype in (np.float32, np.float64) \
        and x.ndim >= 2 and y.ndim >= 2 and x.shape[:-2] == y.shape[:-2] \
        and x.shape[-1] == y.shape[-2] and 0 not in x.shape and 0 not in y.shape \
        and x.size * y.shape[-1] >= _MKL_FROM


def matmul(x, y):
    """``x @ y`` of arrays (numpy's rules), by MKL where used (Note [MKL for the products])
    and the arrays are numpy float32/float64 of one dtype: 2-D operands, or stacks with the
    same batch axes (one call for the stack), each matrix with one unit stride, at least
    ``_MKL_FROM`` multiply-adds in all."""
    if not _takes(x, y):
        return x @ y
    out = np.empty(x.shape[:-1] + y.shape[-1:], x.dtype)
    if x.ndim == 2:
        done = _gemm(x, y, out)
    else:
        xs, ys = _merged(x), _merged(y)
        done = _gemm_stack(xs, ys, out.reshape((-1,) + out.shape[-2:])) \
            if xs is not None and ys is not None else _gemm_pointers(x, y, out)
    return out if done else x @ y
