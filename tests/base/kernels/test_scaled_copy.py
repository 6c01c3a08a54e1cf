"""The reducer's fused divide-and-copy kernels against numpy: CPU (numba), CUDA under the simulator.

Each check takes the kernel module (``hpcgrad.kernels.cpu`` or ``.cuda``), so the CUDA kernels run
the very same checks: ``python tests/base/kernels/test_scaled_copy.py`` with NUMBA_ENABLE_CUDASIM=1
(numba reads it at import, hence a subprocess) runs every CASE through ``hpcgrad.kernels.cuda``.
"""

import itertools
import sys
import warnings

import numpy as np
import pytest

SMALL_PARALLEL_MIN = 64  # PARALLEL_MIN_ELEMENTS for the tests: both paths without 1M elements
SCALES = (0.5, 1 / 3)  # exact and inexact in binary

# name -> (dtype, destination shape, source shapes, offsets, destination size)
COPY_CASES = {
    "f32-small": ("float32", (7,)), "f64-small": ("float64", (3, 5)),
    "f32-large": ("float32", (1000,)), "f64-large": ("float64", (10, 100)),
    "f64-not-block-multiple": ("float64", (257,)), "empty": ("float64", (0,)),
}
MULTI_CASES = {
    # total below SMALL_PARALLEL_MIN: the serial kernel; gaps between the sources stay untouched
    "f32-small": ("float32", [(3,), (2, 2), (5,)], [0, 5, 20], 30),
    # total above it: one thread per source
    "f64-large": ("float64", [(100,), (4, 30), (1,), (60,)], [300, 0, 299, 130], 400),
    "f64-one-empty-source": ("float64", [(4,), (0,), (6,)], [0, 4, 4], 10),
    "f64-no-sources": ("float64", [], [], 5),
}
MULTI_ERRORS = {
    "overrun": ([(4,), (3,)], [0, 8], "overruns the destination of 10"),
    "negative offset": ([(3,)], [-1], "overruns the destination"),
    "overlap": ([(4,), (3,)], [0, 2], "overlaps the one ending at 4"),
    "missing offset": ([(4,), (3,)], [0], "2 sources but 1 offsets"),
}


def _random(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def check_scaled_copy(impl, dtype, shape, scale, in_place=False, to_device=None):
    """``dst[...] = src * scale`` equals numpy's product, bit for bit, in the destination's dtype.

    ``to_device``: upload the in-place array first (the simulator copies each host argument in
    and back out separately, so a host array passed twice would come back unchanged).
    """
    src = _random(shape, dtype, 1)
    want = src * np.dtype(dtype).type(scale)
    if in_place:
        dst = src = src if to_device is None else to_device(src)
    else:
        dst = np.full(shape, np.nan, dtype)
    impl.scaled_copy(dst, src, scale)
    np.testing.assert_array_equal(dst if to_device is None else dst.copy_to_host(), want)


def check_scaled_copy_multi(impl, dtype, shapes, offsets, size, scale):
    """Each source lands scaled at its offset of the flat destination; nothing else changes."""
    srcs = [_random(shape, dtype, i) for i, shape in enumerate(shapes)]
    dst = np.full(size, -7.0, dtype)
    want = dst.copy()
    for src, start in zip(srcs, offsets):
        want[start:start + src.size] = src.reshape(-1) * np.dtype(dtype).type(scale)
    impl.scaled_copy_multi(dst, srcs, offsets, scale)
    np.testing.assert_array_equal(dst, want)


def check_errors(impl):
    """Bad calls raise ValueError and leave the destination alone."""
    dst = np.zeros(10)
    with pytest.raises(ValueError, match="destination has 10 elements, source 9"):
        impl.scaled_copy(dst, np.ones(9), 1.0)
    strided = np.zeros((4, 6))[:, ::2].T  # reshape(-1) of it is a copy: must refuse, not no-op
    with pytest.raises(ValueError, match="must be C-contiguous"):
        impl.scaled_copy(strided, np.ones(strided.shape), 1.0)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        impl.scaled_copy(np.zeros(12), np.ones((4, 6))[:, ::2], 1.0)
    with pytest.raises(ValueError, match="destination must be C-contiguous"):
        impl.scaled_copy_multi(np.zeros((6, 4))[:, ::2], [np.ones(3)], [0], 1.0)
    for shapes, offsets, message in MULTI_ERRORS.values():
        with pytest.raises(ValueError, match=message):
            impl.scaled_copy_multi(dst, [np.ones(s) for s in shapes], offsets, 1.0)
    assert not dst.any()


# --- CPU ---------------------------------------------------------------------------------------
@pytest.fixture
def cpu(monkeypatch):
    """hpcgrad.kernels.cpu, PARALLEL_MIN_ELEMENTS small; ``cpu.launched``: the kernels run."""
    from hpcgrad.kernels import cpu
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", SMALL_PARALLEL_MIN)
    launched = []
    for name in ("_scaled_copy_serial", "_scaled_copy_parallel", "_scaled_copy_multi_serial",
                 "_scaled_copy_multi"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _k=kernel, _n=name: (launched.append(_n), _k(*a)))
    monkeypatch.setattr(cpu, "launched", launched, raising=False)
    return cpu


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("case", COPY_CASES)
def test_cpu_scaled_copy(cpu, case, scale):
    dtype, shape = COPY_CASES[case]
    check_scaled_copy(cpu, dtype, shape, scale)
    parallel = np.prod(shape) >= SMALL_PARALLEL_MIN
    assert cpu.launched == ["_scaled_copy_parallel" if parallel else "_scaled_copy_serial"]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("case", MULTI_CASES)
def test_cpu_scaled_copy_multi(cpu, case, scale):
    dtype, shapes, offsets, size = MULTI_CASES[case]
    check_scaled_copy_multi(cpu, dtype, shapes, offsets, size, scale)
    total = sum(int(np.prod(s)) for s in shapes)
    want = [] if not shapes else ["_scaled_copy_multi" if total >= SMALL_PARALLEL_MIN
                                  else "_scaled_copy_multi_serial"]
    assert cpu.launched == want


@pytest.mark.parametrize("size", [10, 1000])
def test_cpu_scaled_copy_in_place(cpu, size):
    """The reducer divides a gradient that already is its bucket view in place."""
    check_scaled_copy(cpu, "float64", (size,), 1 / 3, in_place=True)


def test_cpu_scaled_copy_multi_converts_dtype(cpu):
    dst = np.zeros(5)
    cpu.scaled_copy_multi(dst, [np.arange(5, dtype=np.float32)], [0], 0.25)
    np.testing.assert_array_equal(dst, np.arange(5) * 0.25)


HALF_DTYPES = {"float16": np.float16, "bfloat16": "bfloat16"}


def _half(name):
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(HALF_DTYPES[name])


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_cpu_scaled_copy_half_precision(cpu, name, scale):
    """float16 and ml_dtypes' bfloat16, which numba cannot compile: computed in float32 and
    rounded once, as PyTorch's mul_out (opmath float), in both kernels; never a numba launch."""
    dtype = _half(name)
    src = _random((300,), np.float32, 3).astype(dtype)
    want = (src.astype(np.float32) * np.float32(scale)).astype(dtype)
    dst = np.zeros(300, dtype)
    cpu.scaled_copy(dst, src, scale)
    np.testing.assert_array_equal(dst.astype(np.float32), want.astype(np.float32))
    flat = np.zeros(310, dtype)
    cpu.scaled_copy_multi(flat, [src[:100], src[100:].reshape(20, 10)], [0, 110], scale)
    np.testing.assert_array_equal(flat[:100].astype(np.float32), want[:100].astype(np.float32))
    np.testing.assert_array_equal(flat[110:].astype(np.float32), want[100:].astype(np.float32))
    assert not flat[100:110].astype(np.float32).any()
    assert cpu.launched == []


@pytest.mark.parametrize("name", HALF_DTYPES)
def test_cpu_scaled_copy_half_precision_matches_torch(cpu, name):
    torch = pytest.importorskip("torch")
    dtype = _half(name)
    src = _random((1000,), np.float32, 4).astype(dtype)
    dst = np.zeros(1000, dtype)
    cpu.scaled_copy(dst, src, 1 / 3)
    theirs = torch.from_numpy(src.astype(np.float32)).to(getattr(torch, name))
    out = torch.empty_like(theirs)
    torch.mul(theirs, 1 / 3, out=out)
    np.testing.assert_array_equal(dst.astype(np.float32), out.float().numpy())


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_cpu_scaled_copy_strided(cpu, dtype):
    """Equal shapes, different layouts (a gradient breaking the layout contract): one pass."""
    src = np.asfortranarray(_random((6, 7), dtype, 5))
    dst = np.zeros((6, 7), dtype)
    cpu.scaled_copy_strided(dst, src, 0.5)
    np.testing.assert_array_equal(dst, src * np.dtype(dtype).type(0.5))
    with pytest.raises(ValueError, match=r"shape \[6, 7\], source \[7, 6\]"):
        cpu.scaled_copy_strided(dst, src.T, 0.5)


def test_cpu_errors(cpu):
    check_errors(cpu)


def test_dispatch_by_array_module(monkeypatch):
    """hpcgrad.kernels sends numpy arrays to the CPU kernels."""
    from hpcgrad import kernels
    from hpcgrad.kernels import cpu
    calls = []
    monkeypatch.setattr(cpu, "scaled_copy", lambda *a: calls.append("copy"))
    monkeypatch.setattr(cpu, "scaled_copy_multi", lambda *a: calls.append("multi"))
    kernels.scaled_copy(np.zeros(3), np.ones(3), 2.0)
    kernels.scaled_copy_multi(np.zeros(3), [np.ones(3)], [0], 2.0)
    assert calls == ["copy", "multi"]


# --- CUDA, under numba's simulator -------------------------------------------------------------
def run_cuda_cases():
    """Every case through hpcgrad.kernels.cuda (run as a script with NUMBA_ENABLE_CUDASIM=1)."""
    from numba import config
    assert config.ENABLE_CUDASIM, "set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
    from numba.cuda import to_device

    from hpcgrad.kernels import cuda
    for dtype, shape in COPY_CASES.values():
        for scale in SCALES:
            check_scaled_copy(cuda, dtype, shape, scale)
    check_scaled_copy(cuda, "float64", (300,), 1 / 3, in_place=True, to_device=to_device)
    for dtype, shapes, offsets, size in MULTI_CASES.values():
        check_scaled_copy_multi(cuda, dtype, shapes, offsets, size, 1 / 3)
    check_errors(cuda)
    with warnings.catch_warnings():  # the overflows are cases (the simulator's threads warn too)
        warnings.simplefilter("ignore", RuntimeWarning)
        with np.errstate(over="ignore"):
            check_cuda_half_precision(cuda)
    check_cuda_many_sources(cuda)
    check_cuda_layout_reused(cuda)
    check_cuda_streams(cuda)
    print("cuda kernels: all cases passed")


def _half_reference(dtype, scale):
    """Sources with rounding ties, specials and near-overflow values, and ``src * scale`` in
    float32 rounded once to ``dtype`` (the reference: numpy's and ml_dtypes' casts)."""
    src = np.concatenate([_random((150,), np.float32, 6) * 100,
                          [0.0, -0.0, np.inf, -np.inf, 1e-8, 3e38, 65504.0, 1.0 + 2.0 ** -8]])
    src = src.astype(np.float32).astype(dtype)
    want = (src.astype(np.float32) * np.float32(scale)).astype(dtype)
    return src, want


def check_cuda_half_precision(cuda):
    """float16 and ml_dtypes' bfloat16 (uint16 bits in the kernel): float32 arithmetic, one
    round-to-nearest-even, bit for bit as numpy/ml_dtypes; NaN stays NaN; both kernels."""
    import ml_dtypes
    # 1/3 is inexact in both (a half-precision scale would round differently); 3 overflows
    # float16 at 65504 and bfloat16 at 3e38.
    for dtype, scale in itertools.product((np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)),
                                          (1 / 3, 3.0)):
        src, want = _half_reference(dtype, scale)
        dst = np.zeros(src.size, dtype)
        cuda.scaled_copy(dst, src, scale)
        np.testing.assert_array_equal(dst.view(np.uint16), want.view(np.uint16), err_msg=str(dtype))
        flat = np.zeros(src.size + 10, dtype)
        cuda.scaled_copy_multi(flat, [src[:100], src[100:]], [0, 110], scale)
        np.testing.assert_array_equal(flat[:100].view(np.uint16), want[:100].view(np.uint16))
        np.testing.assert_array_equal(flat[110:].view(np.uint16), want[100:].view(np.uint16))
        assert not flat[100:110].astype(np.float32).any()
        nan = np.array([np.nan, -np.nan], np.float32).astype(dtype)
        out = np.zeros(2, dtype)
        cuda.scaled_copy(out, nan, 0.5)
        assert np.isnan(out.astype(np.float32)).all()


def check_cuda_many_sources(cuda):
    """More sources than one launch takes (three chunks), sizes 0 to 12 in a shuffled order, one
    chunk all empty; no concatenated copy of the sources is made."""
    rng = np.random.default_rng(7)
    sizes = list(rng.integers(0, 13, size=40))
    sizes[16:32] = [0] * 16  # the second chunk: nothing to launch
    order = rng.permutation(len(sizes))
    offsets, start = [0] * len(sizes), 0
    for t in order:
        offsets[t], start = start, start + int(sizes[t]) + 1  # a gap after each
    srcs = [_random((int(n),), np.float32, i) for i, n in enumerate(sizes)]
    dst = np.full(start, -7.0, np.float32)
    want = dst.copy()
    for src, at in zip(srcs, offsets):
        want[at:at + src.size] = src * np.float32(1 / 3)
    concatenate = np.concatenate
    np.concatenate = None  # a concatenation would fail here
    try:
        cuda.scaled_copy_multi(dst, srcs, offsets, 1 / 3)
    finally:
        np.concatenate = concatenate
    np.testing.assert_array_equal(dst, want)
    assert len(sizes) > 2 * cuda.SOURCES_PER_LAUNCH


def check_cuda_layout_reused(cuda):
    """A bucket's layout table is uploaded once: later calls with new sources reuse it."""
    cuda._LAYOUTS.clear()
    dst = np.zeros(9)
    for seed in (1, 2, 3):
        srcs = [_random((4,), "float64", seed), _random((3,), "float64", seed + 10)]
        cuda.scaled_copy_multi(dst, srcs, [5, 0], 0.5)
        np.testing.assert_array_equal(dst[5:], srcs[0] * 0.5)
        np.testing.assert_array_equal(dst[:3], srcs[1] * 0.5)
        if seed == 1:
            table = cuda._LAYOUTS[((4, 3), (5, 0), -1)]
        assert len(cuda._LAYOUTS) == 1 and cuda._layout([4, 3], [5, 0], -1) is table
    cuda.scaled_copy_multi(dst, srcs, [0, 4], 0.5)  # another layout: another table
    assert len(cuda._LAYOUTS) == 2


def check_cuda_streams(cuda):
    """With cupy arrays, kernels launch on cupy's current stream and import the arrays with
    ``sync=False`` (a stand-in cupy: there is no GPU under the simulator)."""
    from numba import cuda as numba_cuda

    class FakeCupyArray(np.ndarray):
        device = type("Device", (), {"id": 0})()
        data = property(lambda self: type("Memory", (), {"ptr": self.ctypes.data})())

    fake_stream = type("Stream", (), {"ptr": 0xBEEF})()
    fake_cupy = type("cupy", (), {"cuda": type("cuda", (), {
        "get_current_stream": staticmethod(lambda: fake_stream)})})
    calls = []
    real = {name: getattr(cuda.backend, name) for name in ("is_gpu_array", "cupy_module")}
    numba_real = {name: getattr(cuda.cuda, name, None) for name in ("external_stream",
                                                                      "as_cuda_array")}
    cuda.backend.is_gpu_array = lambda a: isinstance(a, FakeCupyArray)
    cuda.backend.cupy_module = lambda: fake_cupy
    cuda.cuda.external_stream = lambda ptr: calls.append(("stream", ptr)) or numba_cuda.stream()
    def as_cuda_array(interface, sync=True):  # a view of the address: no reference to the array
        described = interface.__cuda_array_interface__
        assert isinstance(described["data"][0], int) and not hasattr(interface, "base")
        calls.append(("import", sync))
        return numba_cuda.device_array(described["shape"], described["typestr"])

    cuda.cuda.as_cuda_array = as_cuda_array
    cuda._STREAMS.clear()
    cuda._VIEWS.clear()
    try:
        dst = np.zeros(6).view(FakeCupyArray)
        src = np.ones(6).view(FakeCupyArray)
        for _ in range(2):  # the second time, the views are found by address: no new import
            cuda.scaled_copy(dst, src, 2.0)
        assert calls.count(("import", False)) == 2
        cuda.scaled_copy_multi(dst, [np.ones(2).view(FakeCupyArray)], [0], 2.0)
        assert calls.count(("import", False)) == 3
    finally:
        cuda._VIEWS.clear()
        for name, value in real.items():
            setattr(cuda.backend, name, value)
        for name, value in numba_real.items():
            if value is None:
                delattr(cuda.cuda, name)
            else:
                setattr(cuda.cuda, name, value)
        cuda._STREAMS.clear()
    assert ("stream", 0xBEEF) in calls
    assert [c for c in calls if c[0] == "stream"] == [("stream", 0xBEEF)]  # made once, reused
    assert {c for c in calls if c[0] == "import"} == {("import", False)}


def test_cuda_kernels_under_simulator(launch):
    pytest.importorskip("numba.cuda")
    job = launch([sys.executable, __file__], env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=120)
    assert not job.failed, job.output
    assert "all cases passed" in job.stdout


if __name__ == "__main__":
    run_cuda_cases()
