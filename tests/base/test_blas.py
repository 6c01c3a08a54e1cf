"""base/blas.py: MKL's products beside numpy's (their reference) in every orientation, stride
and stack it takes, numpy's own result for what it does not take, and its errors."""

import numpy as np
import pytest

from hpcgrad.base import blas

needs_mkl = pytest.mark.skipif(blas._find_mkl() is None,
                               reason="MKL is not installed (pip install -e '.[mkl]')")


@pytest.fixture
def mkl(monkeypatch):
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)  # every size (small products go to numpy)
    calls = []
    gemm, stack = blas._gemm, blas._gemm_stack
    monkeypatch.setattr(blas, "_gemm", lambda *args, **kw: calls.append("gemm") or gemm(*args, **kw))
    monkeypatch.setattr(blas, "_gemm_stack",
                        lambda *args: calls.append("stack") or stack(*args))
    pointers = blas._gemm_pointers
    monkeypatch.setattr(blas, "_gemm_pointers",
                        lambda *args: calls.append("pointers") or pointers(*args))
    return calls


def _tolerance(dtype, k):
    return dict(rtol=0, atol=(1e-5 if dtype == np.float32 else 1e-13) * k)


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False),
                                              (True, True)])
def test_every_orientation_and_leading_dimension_equals_numpy(mkl, dtype, trans_a, trans_b):
    rng = np.random.default_rng(int(trans_a) * 2 + int(trans_b))
    m, k, n = 37, 53, 29
    # stored with spare columns (a leading dimension larger than the row), then transposed
    a_store = rng.standard_normal((k, m + 5) if trans_a else (m, k + 5)).astype(dtype)
    b_store = rng.standard_normal((n, k + 3) if trans_b else (k, n + 3)).astype(dtype)
    a = a_store[:, :m].T if trans_a else a_store[:, :k]
    b = b_store[:, :k].T if trans_b else b_store[:, :n]
    got = blas.matmul(a, b)
    assert mkl and got.dtype == dtype and got.flags.c_contiguous and got.shape == (m, n)
    np.testing.assert_allclose(got, a @ b, **_tolerance(dtype, k))


@needs_mkl
def test_stacks_with_the_same_batch_axes_equal_numpy(mkl):
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((2, 3, 16, 8)).astype(np.float32) for _ in range(2))
    got = blas.matmul(q, np.swapaxes(k, -1, -2))  # attention's scores: one call for the 6
    assert mkl == ["stack"]
    np.testing.assert_allclose(got, q @ np.swapaxes(k, -1, -2), **_tolerance(np.float32, 8))


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacks_whose_batch_axes_do_not_merge_equal_numpy_without_a_copy(mkl, dtype):
    # attention's heads: (b, t, h, d) seen as (b, h, t, d), batch strides (t*h*d, d); and batch
    # axes reversed (negative strides) or repeated (stride 0)
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 16, 3 * 3 * 8)).astype(dtype)
    q, k = (qkv[..., i * 24:(i + 1) * 24].reshape(2, 16, 3, 8).swapaxes(1, 2) for i in (0, 1))
    cases = [(q, k.mT), (q[::-1, :, :, :], k.mT), (q[:, ::-2], k.mT[:, ::-2]),
             (np.broadcast_to(q[:1], q.shape), k.mT),
             (rng.standard_normal((3, 2, 4, 5)).astype(dtype).transpose(1, 0, 2, 3)[..., :3],
              rng.standard_normal((2, 3, 3, 6)).astype(dtype))]
    for x, y in cases:
        del mkl[:]
        got = blas.matmul(x, y)
        assert mkl == ["pointers"], (x.strides, y.strides)
        assert got.shape == x.shape[:-1] + y.shape[-1:] and got.flags.c_contiguous
        np.testing.assert_allclose(got, x @ y, **_tolerance(dtype, 8))


@needs_mkl
def test_the_same_bits_whatever_the_alignment(mkl):
    # MKL's reproducible mode (STRICT): an operand one element off a 64-byte boundary gives the
    # same product bit for bit
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 48)).astype(np.float32)
    shifted = np.empty(a.size + 1, np.float32)[1:].reshape(a.shape)
    shifted[...] = a
    assert shifted.ctypes.data % 64 != a.ctypes.data % 64
    np.testing.assert_array_equal(blas.matmul(shifted, b), blas.matmul(a, b))


@pytest.mark.parametrize("x, y", [
    (np.ones((3, 4), np.float32), np.ones((4, 2), np.float64)),  # two dtypes
    (np.ones((3, 4), np.int64), np.ones((4, 2), np.int64)),  # integers
    (np.ones((2, 3, 4), np.float32), np.ones((4, 2), np.float32)),  # a stack times a matrix
    (np.ones((2, 3, 4), np.float32), np.ones((1, 4, 2), np.float32)),  # broadcast batch axes
    (np.ones((0, 4), np.float32), np.ones((4, 2), np.float32)),  # empty
    (np.ones(4, np.float32), np.ones((4, 2), np.float32)),  # 1-D
    (np.ones((3, 8), np.float32)[:, ::2], np.ones((4, 2), np.float32)),  # no unit stride
])
def test_what_it_does_not_take_is_numpys_product(monkeypatch, x, y):
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)
    monkeypatch.setattr(blas, "_gemms", lambda: pytest.fail("MKL was asked"))
    got, want = blas.matmul(x, y), x @ y
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@needs_mkl
def test_products_below_the_threshold_are_numpys(monkeypatch):
    monkeypatch.setattr(blas, "MKL", True)
    calls = []
    gemm = blas._gemm
    monkeypatch.setattr(blas, "_gemm", lambda *args: calls.append(args[0].shape) or gemm(*args))
    small, large = (np.ones((128, 128), np.float32), np.ones((256, 256), np.float32))
    np.testing.assert_array_equal(blas.matmul(small, small), small @ small)
    assert calls == []  # 2^21 multiply-adds
    np.testing.assert_allclose(blas.matmul(large, large), large @ large)
    assert calls == [(256, 256)]  # 2^24


def test_by_default_the_product_is_numpys(monkeypatch):
    monkeypatch.setattr(blas, "MKL", False)
    monkeypatch.setattr(blas, "_gemms", lambda: pytest.fail("MKL was asked"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(blas.matmul(x, x.T), x @ x.T)


def test_settings_and_a_missing_library_say_what_to_do(monkeypatch):
    monkeypatch.setenv("HPCGRAD_BLAS", "openblas")
    with pytest.raises(ValueError, match="'auto', 'numpy' or 'mkl', got 'openblas'"):
        blas._choice()
    monkeypatch.setenv("HPCGRAD_BLAS", "mkl")
    assert blas._choice() == "mkl"
    monkeypatch.delenv("HPCGRAD_BLAS")
    assert blas._choice() == "auto"
    monkeypatch.setattr(blas, "_find_mkl", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install -e \"\.\[mkl\]\""):
        blas._load()


@pytest.mark.parametrize("choice, intel, found, used", [
    ("auto", True, True, True),
    ("auto", False, True, False),  # an AMD CPU: numpy's until MKL is measured there
    ("auto", True, False, False),  # the mkl extra not installed
    ("mkl", False, True, True),
    ("numpy", True, True, False),
])
def test_auto_uses_mkl_where_installed_on_intel(monkeypatch, choice, intel, found, used):
    monkeypatch.setattr(blas, "_intel_cpu", lambda: intel)
    monkeypatch.setattr(blas, "_find_mkl", lambda: "libmkl_rt.so.2" if found else None)
    assert blas._use_mkl(choice) is used


def test_intel_cpu_reads_the_vendor():
    with open("/proc/cpuinfo") as info:
        vendor = next((line for line in info if line.startswith("vendor_id")), "")
    assert blas._intel_cpu() is ("GenuineIntel" in vendor)


def test_auto_falls_back_to_numpy_with_a_warning_when_mkl_does_not_load(monkeypatch):
    def broken():
        raise OSError("libmkl_rt.so.2: cannot open shared object file")
    monkeypatch.setattr(blas, "_CHOICE", "auto")
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)
    monkeypatch.setattr(blas, "_GEMMS", None)
    monkeypatch.setattr(blas, "_load", broken)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.warns(RuntimeWarning, match="did not load.*HPCGRAD_BLAS=numpy silences"):
        got = blas.matmul(x, x.T)
    np.testing.assert_array_equal(got, x @ x.T)
    assert blas.MKL is False  # from then on numpy's, without asking again
    monkeypatch.setattr(blas, "_CHOICE", "mkl")  # asked for by name: the error itself
    monkeypatch.setattr(blas, "MKL", True)
    with pytest.raises(OSError, match="cannot open"):
        blas.matmul(x, x.T)


def _blocks_case(rng, dtype):
    """Products of blocks of strided stacks into blocks of one larger output, as blocked
    causal attention's: (a, b, out) triples and the output they write."""
    heads = rng.standard_normal((2, 9, 3, 5)).astype(dtype)  # (B, L, H, E) -> heads (B, H, L, E)
    q = np.moveaxis(heads, 2, 1)
    k = rng.standard_normal((2, 3, 11, 5)).astype(dtype)
    out = np.full((2, 3, 9, 11), np.nan, dtype)
    triples = [(q[..., 0:4, :], np.swapaxes(k, -1, -2)[..., :6], out[..., 0:4, :6]),
               (q[..., 4:9, :], np.swapaxes(k, -1, -2), out[..., 4:9, :]),
               (q[0, 1], k[0, 1, :2].T, np.empty((9, 2), dtype))]  # a single matrix
    return triples, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("use_mkl", [False, pytest.param(True, marks=needs_mkl)])
def test_matmul_into_writes_each_block_in_place(monkeypatch, dtype, use_mkl):
    monkeypatch.setattr(blas, "MKL", use_mkl)
    rng = np.random.default_rng(3)
    triples, out = _blocks_case(rng, dtype)
    blas.matmul_into(triples)
    for a, b, written in triples:
        np.testing.assert_allclose(written, a @ b, **_tolerance(dtype, a.shape[-1]))
    assert np.isnan(out[..., 0:4, 6:]).all()  # what no block covers stays as it was


@needs_mkl
def test_matmul_into_falls_back_to_numpy_for_what_mkl_does_not_take(monkeypatch):
    monkeypatch.setattr(blas, "MKL", True)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    b = np.broadcast_to(rng.standard_normal((5, 1)).astype(np.float32), (3, 5, 2))  # stride 0
    out = np.empty((3, 4, 2), np.float32)
    t_out = np.empty((2, 3, 4), np.float32).transpose(1, 2, 0)  # no unit stride along a row
    blas.matmul_into([(a, b, out), (a, np.ascontiguousarray(b), t_out)])
    np.testing.assert_allclose(out, a @ b, rtol=1e-6)
    np.testing.assert_allclose(t_out, a @ b, rtol=1e-6)
    empty = np.full((3, 4, 2), np.nan, np.float32)
    blas.matmul_into([(a[..., :0], b[:, :0], empty)])  # an empty sum: zeros
    assert (empty == 0).all()


def test_matmul_into_refuses_shapes_that_do_not_fit():
    a, b = np.ones((2, 3, 4)), np.ones((2, 4, 5))
    with pytest.raises(ValueError, match=r"matmul_into: \[2, 3, 4\] @ \[2, 4, 5\] does not fit "
                                         r"an output of \[2, 3, 4\]"):
        blas.matmul_into([(a, b, np.empty((2, 3, 4)))])
    with pytest.raises(ValueError, match="does not fit"):
        blas.matmul_into([(a, np.ones((1, 4, 5)), np.empty((2, 3, 5)))])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("use_mkl", [False, pytest.param(True, marks=needs_mkl)])
def test_addmm_equals_the_product_then_the_bias(monkeypatch, dtype, use_mkl):
    monkeypatch.setattr(blas, "MKL", use_mkl)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)
    rng = np.random.default_rng(8)
    for m, k, n in ((37, 53, 29), (64, 1024, 48), (1, 5, 3)):
        x = rng.standard_normal((m, k)).astype(dtype)
        w = rng.standard_normal((n, k)).astype(dtype)  # as Linear's: x @ w.T
        bias = rng.standard_normal(n).astype(dtype)
        got = blas.addmm(bias, x, w.T)
        want = x @ w.T
        want += bias
        assert got.dtype == dtype and got.shape == (m, n) and got.flags.c_contiguous
        if use_mkl:  # the bias first, the product's sums onto it: rounding apart
            np.testing.assert_allclose(got, want, **_tolerance(dtype, k))
        else:  # numpy's product, then the add: the same operations
            np.testing.assert_array_equal(got, want)


@needs_mkl
def test_addmm_takes_the_product_then_the_add_for_what_mkl_does_not_take(monkeypatch):
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)
    calls = []
    gemm = blas._gemm
    monkeypatch.setattr(blas, "_gemm", lambda *a, **k: calls.append(k) or gemm(*a, **k))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((4, 5)).astype(np.float32)
    for bias in (rng.standard_normal(5),  # float64: another dtype
                 rng.standard_normal((6, 5)).astype(np.float32)):  # not one row
        want = blas.matmul(x, y)  # MKL's product (the same call), then the add
        want += bias
        calls.clear()
        np.testing.assert_array_equal(blas.addmm(bias, x, y), want)
        assert calls == [{}]  # the plain product (beta 0), then the add


@needs_mkl
def test_matmul_into_kept_groups_follow_new_arrays_of_the_same_shapes(monkeypatch):
    """Note [Grouped products]: a second call with new arrays of the same shapes and strides
    reuses the kept offsets with the new arrays' addresses; other strides get their own."""
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_GROUPS", {})
    monkeypatch.setattr(blas, "_GROUPS_KEPT", 2)
    rng = np.random.default_rng(12)
    for round_ in range(4):
        triples, out = _blocks_case(rng, np.float32)
        if round_ == 3:  # the same shapes, other strides: a transposed copy's view
            triples[1] = (np.ascontiguousarray(triples[1][0]), triples[1][1], triples[1][2])
        blas.matmul_into(triples)
        for a, b, written in triples:
            np.testing.assert_allclose(written, a @ b, **_tolerance(np.float32, a.shape[-1]))
        assert len(blas._GROUPS) == (1 if round_ < 3 else 2)
    pointer_stack = np.ones((3, 2, 4, 5), np.float32)[:, 0]  # batch axes that do not merge
    for _ in range(2):
        assert blas._gemm_pointers(pointer_stack, pointer_stack.transpose(0, 2, 1),
                                   out := np.empty((3, 4, 4), np.float32))
        np.testing.assert_allclose(out, np.full((3, 4, 4), 5.0))
    assert len(blas._GROUPS) == 1  # at the bound of 2 the kept ones were dropped first


def _call_jit(product, a, b, out):
    """Run a JitProduct through ctypes (numba loops call it the same way)."""
    import ctypes
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4)(product.kernel)
    fn(product.jitter, a.ctypes.data, b.ctypes.data, out.ctypes.data)


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, True)])
def test_jit_products_equal_numpy(mkl, dtype, trans_a, trans_b):
    """Note [MKL's JIT products]: small products at leading dimensions wider than the
    matrices (blocks of larger arrays), and one too large for MKL's JIT (its usual gemm)."""
    rng = np.random.default_rng(4)
    for m, n, k in ((3, 4, 5), (64, 128, 64), (200, 150, 170)):
        big_a = rng.standard_normal((k + 3, m + 2) if trans_a else (m + 2, k + 3)).astype(dtype)
        big_b = rng.standard_normal((n + 1, k + 4) if trans_b else (k + 4, n + 1)).astype(dtype)
        a = big_a[:k, :m].T if trans_a else big_a[:m, :k]
        b = big_b[:n, :k].T if trans_b else big_b[:k, :n]
        out = np.full((m, n + 5), np.nan, dtype)
        (la, lda), (lb, ldb) = blas._layout(a), blas._layout(b)
        product = blas.jit_product(dtype, la, lb, m, n, k, lda, ldb, n + 5)
        _call_jit(product, a, b, out)
        np.testing.assert_allclose(out[:, :n], a @ b, **_tolerance(dtype, k))
        assert np.isnan(out[:, n:]).all()  # past the leading dimension's columns: untouched
        assert blas.jit_product(dtype, la, lb, m, n, k, lda, ldb, n + 5) is product  # kept


@needs_mkl
def test_a_jit_product_lives_while_held_when_the_cache_lets_go(mkl, monkeypatch):
    monkeypatch.setattr(blas, "_JITTED", {})
    monkeypatch.setattr(blas, "_JITTED_KEPT", 2)
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    held = blas.jit_product(np.float64, blas._NO_TRANS, blas._NO_TRANS, 2, 4, 3, 3, 4, 4)
    for n in (5, 6):  # the third kernel clears the cache
        blas.jit_product(np.float64, blas._NO_TRANS, blas._NO_TRANS, 2, n, 3, 3, n, n)
    assert len(blas._JITTED) == 1 and held.jitter
    out = np.empty((2, 4))
    _call_jit(held, a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-13)
    monkeypatch.setattr(blas, "MKL", False)
    assert blas.jit_product(np.float64, blas._NO_TRANS, blas._NO_TRANS, 2, 4, 3, 3, 4, 4) is None
