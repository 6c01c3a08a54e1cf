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
    lib = ctypes.CDLL(path)
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
    """(transposed flag, leading dimension) of a 2-D array with one unit stride, else None."""
    item = a.itemsize
    rows, cols = a.shape
    if a.strides[1] == item and a.strides[0] % item == 0 and a.strides[0] >= max(cols, 1) * item:
        return _NO_TRANS, a.strides[0] // item
    if a.strides[0] == item and a.strides[1] % item == 0 and a.strides[1] >= max(rows, 1) * item:
        return _TRANS, a.strides[1] // item
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
    la, lb = _layout(a[0]), _layout(b[0])
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
    first = (0,) * (a.ndim - 2)
    la, lb = _layout(a[first]), _layout(b[first])
    gemms = la and lb and not any(stride % a.itemsize for stride in a.strides + b.strides) \
        and _gemms()
    if not gemms:
        return False
    _, _, pointers, one, zero = gemms[a.dtype]
    (m, k), n = a.shape[-2:], b.shape[-1]
    index = np.indices(a.shape[:-2]).reshape(a.ndim - 2, -1)  # every matrix's batch index
    # each matrix's address (strides may be 0 or negative: signed offsets)
    addresses = [stack.ctypes.data + np.asarray(stack.strides[:-2], np.intp) @ index
                 for stack in (a, b, out)]
    # one group of index.shape[1] products: each parameter an array of one
    group = [(ctypes.c_int * 1)(value) for value in (
        la[0], lb[0], m, n, k, max(1, la[1]), max(1, lb[1]), max(1, n), index.shape[1])]
    trans_a, trans_b, m_, n_, k_, lda, ldb, ldc, size = group
    alpha, beta = (type(one) * 1)(one), (type(zero) * 1)(zero)
    a_, b_, c_ = (ctypes.c_void_p(address.ctypes.data) for address in addresses)
    pointers(_ROW_MAJOR, trans_a, trans_b, m_, n_, k_, alpha, a_, lda, b_, ldb, beta, c_, ldc,
             1, size)
    return True


def matmul_into(products):
    """``out[...] = a @ b`` for each (a, b, out) of ``products``: stacks with the same batch
    axes at any strides, each matrix (out's too) with one unit stride, so that blocks of larger
    arrays are written in place (blocked causal attention, nn/_causal_attention.py). One MKL
    call for all (``?gemm_batch``, a group per product) where MKL is used and every operand is
    numpy float32/float64 of one dtype; else numpy's ``matmul(a, b, out=out)`` per product.
    Empty products (a zero-sized side) write nothing, or zeros where the sum is empty."""
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
    first = work[0][0]
    gemms = MKL and type(first) is np.ndarray and first.dtype in (np.float32, np.float64) \
        and all(type(x) is np.ndarray and x.dtype == first.dtype and x.ndim >= 2
                and not any(stride % x.itemsize for stride in x.strides)
                for triple in work for x in triple) and _gemms()
    layouts = [[_layout(x[(0,) * (x.ndim - 2)]) for x in triple] for triple in work] \
        if gemms else None
    if not gemms or any(None in lay or lay[2][0] != _NO_TRANS for lay in layouts):
        for a, b, out in work:
            np.matmul(a, b, out=out)
        return
    _, _, pointers, one, zero = gemms[first.dtype]
    groups = len(work)
    ints = {name: (ctypes.c_int * groups)() for name in
            ("ta", "tb", "m", "n", "k", "lda", "ldb", "ldc", "size")}
    addresses = []
    for g, ((a, b, out), (la, lb, lc)) in enumerate(zip(work, layouts)):
        index = np.indices(a.shape[:-2]).reshape(a.ndim - 2, -1) if a.ndim > 2 \
            else np.zeros((0, 1), np.intp)  # one matrix
        for x in (a, b, out):  # each matrix's address (signed strides, as _gemm_pointers)
            addresses.append(x.ctypes.data + np.asarray(x.strides[:-2], np.intp) @ index)
        values = (la[0], lb[0], a.shape[-2], b.shape[-1], a.shape[-1], max(1, la[1]),
                  max(1, lb[1]), max(1, lc[1]), index.shape[1])
        for name, value in zip(("ta", "tb", "m", "n", "k", "lda", "ldb", "ldc", "size"),
                               values):
            ints[name][g] = value
    # the addresses group by group: all a's, all b's, all c's, each in the groups' order
    a_all, b_all, c_all = (np.concatenate(addresses[i::3]).astype(np.intp)
                           for i in range(3))
    alpha, beta = (type(one) * groups)(*[one.value] * groups), \
        (type(zero) * groups)(*[zero.value] * groups)
    pointers(_ROW_MAJOR, ints["ta"], ints["tb"], ints["m"], ints["n"], ints["k"], alpha,
             ctypes.c_void_p(a_all.ctypes.data), ints["lda"], ctypes.c_void_p(b_all.ctypes.data),
             ints["ldb"], beta, ctypes.c_void_p(c_all.ctypes.data), ints["ldc"], groups,
             ints["size"])


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
