"""Array-module dispatch: numpy on the CPU, cupy on GPUs, without importing cupy where it cannot work."""

import numpy as np

try:  # cupy is an optional extra; a machine without a GPU must still import hpcgrad.
    import cupy as _cupy
except Exception:  # ImportError, or a CUDA error raised while cupy loads
    _cupy = None

CPU = "cpu"


def cupy_module():
    """The cupy module when it is importable, else None (it may still have no usable device)."""
    return _cupy


def device_count():
    """Number of usable CUDA devices: 0 when cupy is missing or no driver/device answers."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def use_device(index):
    """Make CUDA device ``index`` current for this thread (nothing to do without cupy)."""
    if _cupy is not None and index >= 0:
        _cupy.cuda.Device(index).use()


def is_gpu_array(array):
    return _cupy is not None and isinstance(array, _cupy.ndarray)


def get_array_module(array):
    """numpy or cupy, whichever owns ``array`` (numpy for Python scalars)."""
    if type(array) is np.ndarray or _cupy is None:
        return np
    return _cupy.get_array_module(array)


def device_of(array):
    """``"cpu"`` for host arrays, ``"cuda:N"`` for a cupy array on device N."""
    if type(array) is np.ndarray or not is_gpu_array(array):
        return CPU
    return f"cuda:{array.device.id}"


def device_index(device):
    """-1 for the CPU, N for ``"cuda:N"``: the engine's worker-queue index."""
    if device == CPU:
        return -1
    return int(device.split(":")[1])


def to_device(array, device):
    """Copy ``array`` to ``device`` (``"cpu"`` or ``"cuda:N"``) if it is not there already."""
    if device_of(array) == device:
        return array
    if device == CPU:
        return _cupy.asnumpy(array)
    _require_gpu(device, "move an array to")
    with _cupy.cuda.Device(device_index(device)):
        return _cupy.asarray(array)


def _require_gpu(device, what):
    """PyTorch's errors first (what users search for), then why and how to fix it here."""
    if _cupy is None:
        raise RuntimeError(f"Torch not compiled with CUDA enabled: hpcgrad cannot {what} "
                           f"{device}: cupy is not installed (pip install 'hpcgrad[cuda12]')")
    count = device_count()
    if count == 0:
        raise RuntimeError(f"No CUDA GPUs are available: hpcgrad cannot {what} {device} (cupy "
                           "is installed, but no CUDA device or driver answers on this node)")
    if device_index(device) >= count:
        raise RuntimeError(f"CUDA error: invalid device ordinal: {device}, but this node has "
                           f"{count} GPU(s) (cuda:0 to cuda:{count - 1})")


def zeros(shape, dtype, device=CPU):
    """Zeros on ``device`` ("cpu" or "cuda:N")."""
    if device == CPU:
        return np.zeros(shape, dtype)
    _require_gpu(device, "make an array on")
    with _cupy.cuda.Device(device_index(device)):
        return _cupy.zeros(shape, dtype)
