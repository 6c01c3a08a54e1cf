"""Arrays -> MPI buffers: dtype map, contiguity checks, and CUDA-aware or host-staged GPU memory.

This is the one place that synchronizes a GPU stream before MPI touches device memory.

Note [Device buffers before MPI]
    MPI reads and writes memory from the host's point of view: before it touches a device array
    (directly, with a CUDA-aware MPI, or through a host copy) the kernels that produced the
    array must be done. hpcgrad waits on an event recorded on the producer's stream, in one
    place, ``device_ready_event`` here (MessageBuffer and the reducer's bucket staging call it):
    not on the whole device, and not on whatever stream the caller happens to call current, so
    work enqueued on other streams is not waited for and work enqueued later on the producer's
    stream (the rest of backward) goes on.

    Which stream produced the array: ``stream=`` when the caller knows it; otherwise cupy's
    current stream of the calling thread. In hpcgrad that default is the producer's: gradients
    are computed by the engine's device thread for that device (Note [Layers]: engine), and the
    hooks that hand them to communication (the reducer's autograd hooks, comm hooks, a
    collective called in a hook) run on that same thread, right after the kernels that wrote
    the gradient (and the divide-and-copy into the bucket view, which launches on cupy's
    current stream, kernels.py) were enqueued on its current stream. A caller that computes on
    a stream of its own and then calls a collective from another thread must pass ``stream=``.

    With a CUDA-aware MPI the event is synchronized before the MPI spec is built. Without one,
    the event orders a device-to-host copy on a side stream instead (Note [Host staging that
    overlaps] in staging.py) and MPI gets the pinned host copy once that copy completes.
"""

import numpy as np
from mpi4py import MPI

from hpcgrad.base import backend
from hpcgrad.comm.mpi import cuda_aware_mpi
from hpcgrad.comm.staging import STAGING


def _mpi_type(name):
    datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
    return None if datatype == MPI.DATATYPE_NULL else datatype


_MPI_TYPES = {
    np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.int64): MPI.INT64_T, np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int16): MPI.INT16_T, np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint64): MPI.UINT64_T, np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint16): MPI.UINT16_T, np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX, np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
def _usable_float16():
    """MPI's float16 type where the library can send and sum with it, else None.

    MPI 4.1 names it and MPICH 5 has it. mpi4py also hands out a handle on an MPI that only
    half-supports it (Open MPI 4.1 as Debian builds it: every call with it fails with
    MPI_ERR_TYPE, seen on a GPU machine), so one small sum and one max on COMM_SELF decide."""
    datatype = _mpi_type("FLOAT16_T")
    if datatype is None:
        return None
    try:
        ones, out = np.ones(2, np.float16), np.zeros(2, np.float16)
        for op in (MPI.SUM, MPI.MAX):
            MPI.COMM_SELF.Allreduce([ones, datatype], [out, datatype], op=op)
    except Exception:  # noqa: BLE001  (MPI's error, or mpi4py's refusal of a null handle)
        return None
    return datatype if np.array_equal(out, ones) else None


_FLOAT16 = _usable_float16()
if _FLOAT16 is not None:
    _MPI_TYPES[np.dtype(np.float16)] = _FLOAT16
# Types without an MPI equivalent here (bfloat16 from ml_dtypes; float16 on older MPIs) travel
# as float32: exact for these narrower types, and sums come back rounded once, not per step.
_UPCAST = {"float16", "bfloat16"}

# A small number per dtype that can travel with a message or a call's fingerprint (Note [Checked
# receives] in process_group.py, HPCGRAD_DISTRIBUTED_DEBUG=INFO in debug.py): 1..15, 4 bits.
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
               "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "complex128")
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES, start=1)}


_CODE_OF_DTYPE = {}  # dtype -> code: numpy computes dtype.name in Python (~1-3 us a read)


def dtype_code(dtype):
    """``dtype``'s code in DTYPE_CODES (0 for a dtype MessageBuffer refuses anyway)."""
    code = _CODE_OF_DTYPE.get(dtype)
    if code is None:
        code = _CODE_OF_DTYPE[dtype] = DTYPE_CODES.get(dtype.name, 0)
    return code


def dtype_name(code):
    return DTYPE_NAMES[code - 1] if 1 <= code <= len(DTYPE_NAMES) else f"<dtype code {code}>"

_cuda_aware = None


def cuda_aware():
    """Whether device arrays go to MPI directly (decided once; see hpcgrad.mpi.cuda_aware_mpi)."""
    global _cuda_aware
    if _cuda_aware is None:
        _cuda_aware = cuda_aware_mpi()[0]
    return _cuda_aware


def device_ready_event(array, stream=None):
    """An event recorded on the stream that produced the device ``array``: once it completes,
    MPI (or a copy ordered after it) may read the array (Note [Device buffers before MPI])."""
    cupy = backend.cupy_module()
    with cupy.cuda.Device(array.device.id):
        if stream is None:
            stream = cupy.cuda.get_current_stream()
        event = cupy.cuda.Event(disable_timing=True)
        event.record(stream)
    return event


def stage_device_array(array, stream=None):
    """Start the pinned host copy of the contiguous device ``array`` after its producer's work;
    returns the StagedCopy (staging.py) without blocking: ``wait()`` it before MPI reads the
    host copy, ``copy_back()`` after MPI wrote it, then ``release()``."""
    return STAGING.stage(backend.cupy_module(), array, device_ready_event(array, stream))


def is_array(x):
    """Whether ``x`` is a numpy or cupy array (what this layer sends; it knows no Tensor)."""
    return isinstance(x, np.ndarray) or backend.is_gpu_array(x)


def is_floating(dtype):
    """Floating point for ReduceOp.AVG: float16/32/64, complex, and bfloat16 (numpy kind 'V')."""
    return dtype.kind in "fc" or dtype.name in _UPCAST


class MessageBuffer:
    """What MPI reads or writes for one array, and the copy back when it had to be staged.

    MPI gets the array itself when it can (host memory of a known MPI type, or device memory
    with a CUDA-aware MPI); otherwise a host or float32 copy, written back by ``finish()``.
    """

    __slots__ = ("array", "spec", "staged", "transfer", "writable")

    def __init__(self, array, writable=False, name="tensor", upcast=False, stream=None):
        """``upcast``: send float16 as float32 even where MPI has a float16 type (for AVG, whose
        sum would overflow 65504 before the division). ``stream``: the stream that produced a
        device ``array`` (default: cupy's current stream; Note [Device buffers before MPI])."""
        if type(array) is np.ndarray:  # the hot path: one flags object, one dict lookup
            flags = array.flags
            if not flags.c_contiguous:
                raise _not_contiguous(array, name)
            if writable and not flags.writeable:
                raise _read_only(name)
            mpi_type = _MPI_TYPES.get(array.dtype)
            if mpi_type is not None and not (upcast and array.dtype.name in _UPCAST):
                self.array = self.staged = array
                self.writable = writable
                self.spec = [array, mpi_type]
                return
        else:
            if not array.flags.c_contiguous:
                raise _not_contiguous(array, name)
            if writable and not getattr(array.flags, "writeable", True):
                raise _read_only(name)
        self.array, self.writable, self.transfer = array, writable, None
        staged = array
        if backend.is_gpu_array(array):
            if cuda_aware():
                device_ready_event(array, stream).synchronize()
            else:  # a pinned host copy from the pool; MPI reads it once the copy is done
                self.transfer = stage_device_array(array, stream)
                staged = self.transfer.wait()
        dtype = staged.dtype
        mpi_type = None if upcast and dtype.name in _UPCAST else _MPI_TYPES.get(dtype)
        if mpi_type is None:
            if dtype.name not in _UPCAST:
                raise TypeError(f"{name} has dtype {dtype}, which hpcgrad cannot send over MPI; "
                                f"supported: {sorted(str(d) for d in _MPI_TYPES)} plus float16/"
                                "bfloat16 (sent as float32)")
            staged = staged.astype(np.float32) if not backend.is_gpu_array(staged) \
                else staged.astype("float32")
            mpi_type = MPI.FLOAT
        self.staged = staged
        self.spec = [staged, mpi_type]

    @property
    def is_staged(self):
        return self.staged is not self.array

    def finish(self):
        """Write received data back into the caller's array if MPI worked on a copy; give a
        pinned staging buffer back (the buffer is done with once this returns)."""
        transfer = getattr(self, "transfer", None)  # unset on the host fast path
        if transfer is not None:
            self.transfer = None
            last_use = None
            if self.writable:
                if self.staged is not transfer.host:  # float32 for a float16/bfloat16 array
                    np.copyto(transfer.host, self.staged, casting="unsafe")
                last_use = transfer.copy_back()  # completed: any stream may read the array
            transfer.release(last_use)
        elif self.writable and self.staged is not self.array:
            if backend.is_gpu_array(self.array):  # CUDA-aware, float32 on the device
                self.array[...] = self.staged.astype(self.array.dtype)
            else:
                np.copyto(self.array, self.staged, casting="unsafe")


def _not_contiguous(array, name):
    return ValueError(f"{name} must be contiguous for MPI (shape {list(array.shape)}, strides "
                      f"{list(array.strides)}); pass a contiguous copy, e.g. "
                      "numpy.ascontiguousarray(x) or x.clone()")


def _read_only(name):
    return ValueError(f"{name} is read-only (writeable=False, e.g. numpy.frombuffer over bytes) "
                      "and cannot receive data; pass a writable copy, e.g. x.copy()")
