"""The CUDA column kernels of kernels/cuda_columns.py (im2col, col2im_add) beside the CPU loops and
numpy's window expressions: under numba's simulator without a GPU, on cupy arrays with one.

``python tests/base/kernels/test_cuda_columns.py`` with NUMBA_ENABLE_CUDASIM=1 (numba reads it at
import, hence a subprocess) launches both kernels on tiny numpy arrays, blocks of 16 threads (the
simulator runs each thread as a Python thread), over strides 1-3, dilations 1-2, 1x1 to 3x3
kernels, rectangular planes, a group's channels and a chunk's samples inside larger arrays, and
no samples; both equal the CPU loops to the bit (each column element is a copy, each gradient
element the same sum in the same order). Then the wiring: nn/_conv.py takes arrays it sees as
cupy ones to these kernels where HPCGRAD_CUDA_COLUMNS=1, and not where it is 0.
"""

import os

import numpy as np
import pytest

from cuda_stand_in import run_under_simulator, stand_in_cupy
from hpcgrad.base import backend

# (N, C, Hp, Wp, Cg, c0, start, m, kh, kw, stride, dilation)
CASES = [(2, 3, 5, 5, 3, 0, 0, 2, 3, 3, (1, 1), (1, 1)),
         (3, 4, 7, 6, 2, 2, 1, 2, 3, 3, (2, 2), (1, 1)),
         (2, 2, 6, 9, 2, 0, 1, 1, 2, 3, (1, 3), (2, 1)),
         (2, 3, 4, 4, 1, 1, 0, 2, 1, 1, (2, 2), (1, 1)),
         (1, 2, 8, 7, 2, 0, 0, 1, 3, 2, (3, 2), (2, 2))]


def _out_size(size, k, stride, dilation):
    return (size - dilation * (k - 1) - 1) // stride + 1


def check_columns(impl, xp, to_host):
    from hpcgrad.base.kernels import cpu
    from hpcgrad.nn._conv import offsets, windows
    rng = np.random.default_rng(31)
    for dtype in (np.float32, np.float64):
        for n, c, hp, wp, cg, c0, start, m, kh, kw, stride, dilation in CASES:
            x = rng.standard_normal((n, c, hp, wp)).astype(dtype)
            ho, wo = (_out_size(hp, kh, stride[0], dilation[0]),
                      _out_size(wp, kw, stride[1], dilation[1]))
            shape = (cg, kh, kw, m, ho, wo)
            want = np.empty(shape, dtype)
            cpu.im2col(x, start, c0, want, stride, dilation)
            got = xp.asarray(np.full(shape, np.nan, dtype))
            impl.im2col(xp.asarray(x), start, c0, got, stride, dilation)
            got = to_host(got)
            what = f"{dtype.__name__} {(n, c, hp, wp)} k{(kh, kw)} s{stride} d{dilation}"
            np.testing.assert_array_equal(got, want, err_msg="im2col " + what)
            formula = windows(x, (kh, kw), stride, dilation)[start:start + m, c0:c0 + cg]
            np.testing.assert_array_equal(got, formula.transpose(1, 4, 5, 0, 2, 3), err_msg=what)

            d = rng.standard_normal(shape).astype(dtype)
            target = rng.standard_normal((n, c, hp, wp)).astype(dtype)
            want = target.copy()
            cpu.col2im_add(d, want, start, c0, stride, dilation)
            device = xp.asarray(target.copy())
            impl.col2im_add(xp.asarray(d), device, start, c0, stride, dilation)
            got = to_host(device)
            np.testing.assert_array_equal(got, want, err_msg="col2im_add " + what)
            formula = target.copy()
            part = formula[start:start + m, c0:c0 + cg]
            for _, i, j, rows, columns in offsets((kh, kw), stride, dilation, (ho, wo)):
                part[:, :, rows, columns] += d[:, i, j].transpose(1, 0, 2, 3)
            np.testing.assert_allclose(got, formula, rtol=1e-6, atol=1e-6, err_msg=what)
    # no samples in the chunk: nothing written
    x = xp.asarray(np.ones((1, 1, 3, 3), np.float32))
    impl.im2col(x, 0, 0, xp.asarray(np.empty((1, 1, 1, 0, 3, 3), np.float32)), (1, 1), (1, 1))
    target = xp.asarray(np.ones((1, 1, 3, 3), np.float32))
    impl.col2im_add(xp.asarray(np.empty((1, 1, 1, 0, 3, 3), np.float32)), target, 0, 0, (1, 1),
                    (1, 1))
    assert (to_host(target) == 1).all()


# --- under the simulator -------------------------------------------------------------------------
def check_wiring(impl):
    """nn/_conv.py takes arrays it sees as cupy (a stand-in: there is no cupy here) to these
    kernels only where switched on; planes (kernels/unfold.py) stay numpy's."""
    from hpcgrad.base.kernels import cpu
    from hpcgrad.nn import _conv
    with stand_in_cupy() as fake:
        x = np.random.default_rng(9).standard_normal((2, 3, 6, 6)).astype(np.float32)
        os.environ["HPCGRAD_CUDA_COLUMNS"] = "0"  # opt-in: off, cupy arrays keep the formulas
        assert _conv._column_loops(fake(x)) is None
        os.environ["HPCGRAD_CUDA_COLUMNS"] = "1"
        assert _conv._column_loops(fake(x)) is impl
        assert _conv._column_loops(fake(x)[:, :, ::2]) is None  # not contiguous
        assert _conv._column_loops(fake(x.astype(np.float16))) is None
        assert _conv._column_loops(fake(x), x) is None  # mixed devices
        assert _conv._column_loops(x) is cpu
        geo = _conv._Geometry(x.shape, (4, 3, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1)
        # stride 2 reads numpy's planes (kernels/unfold.py, CPU only), never a device array's
        assert isinstance(_conv._unfold_source(x, geo)[1], _conv._PlaneUnfold)
        assert not isinstance(_conv._unfold_source(fake(x), geo)[1], _conv._PlaneUnfold)


def run_simulator_cases():
    from numba import config
    assert config.ENABLE_CUDASIM, "set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
    from hpcgrad.base.kernels import cuda_columns
    cuda_columns.THREADS = 16
    check_columns(cuda_columns, np, np.asarray)
    check_wiring(cuda_columns)
    print("cuda columns: all cases passed")


def test_cuda_columns_under_simulator(launch):
    run_under_simulator(launch, __file__, "HPCGRAD_CUDA_COLUMNS")


# --- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_kernels_on_cupy_arrays():
    from hpcgrad.base.kernels import cuda_columns
    cupy = backend.cupy_module()
    check_columns(cuda_columns, cupy, cupy.asnumpy)


@pytest.mark.gpu
def test_convolutions_take_the_kernels_on_the_gpu(monkeypatch):
    """Conv2d on cuda tensors (strided, so the input gradient goes through col2im) unfolds and
    folds with these kernels, forward and backward, and gives the CPU's results."""
    import hpcgrad as hg
    import hpcgrad.nn.functional as F
    from hpcgrad.base.kernels import cuda_columns
    monkeypatch.setenv("HPCGRAD_CUDA_COLUMNS", "1")  # opt-in until this test has passed on a GPU
    calls = []
    for name in ("im2col", "col2im_add"):
        original = getattr(cuda_columns, name)
        monkeypatch.setattr(cuda_columns, name, lambda *a, _f=original, _n=name:
                            calls.append(_n) or _f(*a))
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    runs = {}
    for device in ("cpu", "cuda:0"):
        xt = hg.tensor(x, requires_grad=True).to(device)
        xt.retain_grad()
        wt = hg.tensor(w, requires_grad=True).to(device)
        wt.retain_grad()
        out = F.conv2d(xt, wt, stride=2, padding=1)
        (out * out).sum().backward()
        runs[device] = [out.detach().cpu().numpy(), xt.grad.cpu().numpy(), wt.grad.cpu().numpy()]
    for a, b in zip(*runs.values()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert set(calls) == {"im2col", "col2im_add"}, calls


if __name__ == "__main__":
    run_simulator_cases()
