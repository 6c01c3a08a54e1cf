"""hpcgrad.cuda: PyTorch's torch.cuda device calls for a rank's one GPU (cupy underneath)."""

from hpcgrad.base import backend


def is_available():
    """True when cupy is installed and at least one CUDA device answers."""
    return backend.device_count() > 0


def device_count():
    return backend.device_count()


def set_device(device):
    """Make GPU ``device`` (an int, or "cuda:N") current for this thread, as
    ``torch.cuda.set_device(local_rank)``: a rank uses one GPU, chosen from its local rank
    (``hpcgrad.distributed.get_local_rank()``); its arrays, kernels and engine work go there."""
    index = backend.device_index(device) if isinstance(device, str) else device
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"set_device: expected a device index >= 0 or 'cuda:N', got {device!r}")
    count = backend.device_count()
    if index >= count:
        why = ("cupy is not installed (pip install -e '.[cuda12]' or '.[cuda13]')"
               if backend.cupy_module() is None else f"{count} CUDA device(s) answer")
        raise RuntimeError(f"set_device({device!r}): no such GPU: {why}. With several ranks per "
                           f"node, pass the local rank modulo the GPUs per node")
    backend.use_device(index)


def current_device():
    """The index of this thread's current GPU (-1 when there is none)."""
    cupy = backend.cupy_module()
    if cupy is None or not is_available():
        return -1
    return int(cupy.cuda.Device().id)
