"""PyTorch's torch.accelerator: the one accelerator kind hpcgrad drives, CUDA GPUs through cupy."""

from . import backend, cuda
from .devices import device


def is_available():
    """True when a CUDA GPU answers (cupy installed and a device present)."""
    return cuda.is_available()


def device_count():
    return backend.device_count()


def current_accelerator(check_available=False):
    """``device("cuda")`` when cupy sees a GPU, else None (PyTorch's: the accelerator this
    build has; hpcgrad has one only where cupy and a GPU are there)."""
    return device("cuda") if backend.device_count() > 0 else None
