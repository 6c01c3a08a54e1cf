"""MessageBuffer: dtype map, the float32 upcast, contiguity and read-only checks, device staging (tests/comm/test_staging.py)."""

import dist_cases as cases
import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.comm import buffers
from hpcgrad.comm.buffers import MessageBuffer
from hpcgrad.comm.mpi import MPI
from hpcgrad.distributed import ReduceOp
from hpcgrad.distributed.api import as_array
from hpcgrad.tensor import Tensor

NATIVE = {"float64": MPI.DOUBLE, "float32": MPI.FLOAT, "float16": MPI.FLOAT16_T,
          "int64": MPI.INT64_T, "int32": MPI.INT32_T, "int16": MPI.INT16_T, "int8": MPI.INT8_T,
          "uint8": MPI.UINT8_T, "bool": MPI.C_BOOL, "complex128": MPI.C_DOUBLE_COMPLEX}


@pytest.fixture
def without_float16(monkeypatch):
    """An MPI without MPI_FLOAT16_T (before MPI 4.1): float16 must take the float32 path."""
    types_ = dict(buffers._MPI_TYPES)
    del types_[np.dtype(np.float16)]
    monkeypatch.setattr(buffers, "_MPI_TYPES", types_)


@pytest.mark.parametrize("name", NATIVE)
def test_native_types_go_to_mpi_as_they_are(name):
    if name == "float16" and buffers._FLOAT16 is None:
        pytest.skip("this MPI cannot send or sum with its float16 type: float16 travels as float32")
    a = np.zeros(3, name)
    buf = MessageBuffer(a, writable=True)
    assert buf.spec[0] is a and buf.spec[1] == NATIVE[name] and not buf.is_staged


def check_upcast(dtype):
    """The staging round trip: float32 copy out, MPI writes it, finish() rounds it back."""
    a = np.array([1.5, -2.0, 3.0], dtype)
    buf = MessageBuffer(a, writable=True)
    assert buf.is_staged and buf.spec[1] == MPI.FLOAT and buf.staged.dtype == np.float32
    np.testing.assert_array_equal(buf.staged, a.astype(np.float32))
    buf.staged[...] = [1 / 3, 2049.0, -0.0]  # MPI's result: not representable in 16 bits
    buf.finish()
    np.testing.assert_array_equal(a, np.array([1 / 3, 2049.0, -0.0], np.float32).astype(dtype))


def test_float16_upcast_forced(without_float16):
    check_upcast(np.float16)


def test_bfloat16_upcast():
    if cases.BFLOAT16 is None:
        pytest.skip("bfloat16 needs ml_dtypes (the 'test' extra)")
    check_upcast(cases.BFLOAT16)


def test_staged_send_buffer_is_never_written_back(without_float16):
    a = np.ones(2, np.float16)
    buf = MessageBuffer(a)  # read by MPI only
    buf.staged[...] = 7
    buf.finish()
    assert np.all(a == 1)


def test_non_contiguous():
    with pytest.raises(ValueError, match=r"^output must be contiguous for MPI \(shape \[3, 2\], "
                                         r"strides \[8, 24\]\); pass a contiguous copy, e\.g\. "
                                         r"numpy\.ascontiguousarray\(x\) or x\.clone\(\)$"):
        MessageBuffer(np.zeros((2, 3)).T, name="output")
    with pytest.raises(ValueError, match="must be contiguous"):
        MessageBuffer(np.zeros(6, np.float16)[::2])  # before any staging


def test_read_only():
    a = np.zeros(3)
    a.flags.writeable = False
    assert MessageBuffer(a).spec[0] is a  # sending from it is fine
    with pytest.raises(ValueError, match=r"^tensor is read-only \(writeable=False"):
        MessageBuffer(a, writable=True)


def test_unsupported_dtype_lists_the_supported_ones():
    with pytest.raises(TypeError, match=r"tensor has dtype <U1, which hpcgrad cannot send over "
                                        r"MPI; supported: \[.*'float32'.*\] plus float16/bfloat16"):
        MessageBuffer(np.array(["a"]))


def test_empty_and_zero_dimensional_arrays():
    assert MessageBuffer(np.zeros(0)).spec[0].size == 0
    assert MessageBuffer(np.array(2.0), writable=True).spec[1] == MPI.DOUBLE


def test_as_array():
    a = np.zeros(2)
    assert as_array(a) is a and as_array(Tensor(a)) is a
    view = a.view(DeviceArray)  # any ndarray subclass passes (here not taken for a GPU array)
    assert as_array(view) is view
    with pytest.raises(TypeError, match="expected an hpcgrad Tensor or a numpy/cupy array, got "
                                        "tuple"):
        as_array((1, 2))


# --- device staging, exercised with a stand-in device (numpy memory) ----------------------------
class DeviceArray(np.ndarray):
    """Stands for a cupy array: numpy memory, but not a host numpy array to MessageBuffer."""


# Device staging with a stand-in cupy: tests/comm/test_staging.py.


# --- real GPUs (skipped without one) -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("aware", ["0", "1"])
def test_cupy_buffers(monkeypatch, aware):
    import cupy
    monkeypatch.setattr(buffers, "_cuda_aware", aware == "1")
    a = cupy.arange(4, dtype=cupy.float32)
    buf = MessageBuffer(a, writable=True)
    assert buf.is_staged is (aware == "0")
    buf.staged[...] = 5
    buf.finish()
    assert cupy.asnumpy(a).tolist() == [5, 5, 5, 5]


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_cupy_all_reduce(world):
    import cupy
    x = cupy.full(8, dist.get_rank() + 1, dtype=cupy.float32)
    dist.all_reduce(x)
    n = dist.get_world_size()
    assert cupy.asnumpy(x).tolist() == [n * (n + 1) / 2] * 8


# --- the staged path across ranks ----------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
def test_staged_float16_reductions(world, without_float16, op):
    """Every rank forces the float32 path; results match the native path's reference."""
    cases.check_all_reduce("float16", op, "sync-array")
    cases.check_reduce_scatter("float16", op, "wait-tensor")
    cases.check_all_gather("float16", "sync-array")


def test_average_upcasts_float16_even_where_mpi_has_it():
    a = np.ones(2, np.float16)
    assert MessageBuffer(a, upcast=True).spec[1] == MPI.FLOAT
    assert MessageBuffer(np.ones(2), upcast=True).spec[1] == MPI.DOUBLE


@pytest.mark.mpi
@pytest.mark.parametrize("staged", ["native-float16", "without-float16"])
def test_average_does_not_overflow(world, request, staged):
    """40000 is a float16, 2 x 40000 is not (> 65504): the float32 sum is divided, then rounded."""
    if staged == "without-float16":
        request.getfixturevalue("without_float16")
    x = np.full(4, 40000, np.float16)
    dist.all_reduce(x, ReduceOp.AVG)
    assert np.all(x == 40000)


def test_float16_type_that_mpi_cannot_use_is_not_used(monkeypatch):
    """An MPI that hands out a float16 handle its calls refuse (Open MPI 4.1 as Debian builds it
    fails every call with MPI_ERR_TYPE, seen on a GPU machine) gets float16 sent as float32."""
    from mpi4py import MPI
    monkeypatch.setattr(buffers, "_mpi_type", lambda name: MPI.Datatype())  # a null handle
    assert buffers._usable_float16() is None
    monkeypatch.undo()
    working = buffers._usable_float16()
    assert working is None or working.Get_size() == 2
