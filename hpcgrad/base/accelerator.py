"""PyTorch's torch.accelerator: the one accelerator kind hpcgrad drives, CUDA GPUs through cupy."""

from hpcgrad.base import backend, cuda
from hpcgrad.base.devices import device

hpcgrad_device = device  # (set_device_index's argument is also named device)


def is_available():
    """True when a CUDA GPU answers (cupy installed and a device present)."""
    return cuda.is_available()


def device_count():
    return backend.device_count()


def current_accelerator(check_available=False):
    """``device("cuda")`` when cupy sees a GPU, else None (PyTorch's: the accelerator this
    build has; hpcgrad has one only where cupy and a GPU are there)."""
    return device("cuda") if backend.device_count() > 0 else None


class device_index:
    """``with accelerator.device_index(i):`` makes GPU ``i`` current inside the block and
    restores the previous one after (None: no change), as torch.accelerator.device_index; called
    without ``with`` it changes nothing, as PyTorch's."""

    def __init__(self, device, /):
        self.device, self.previous = device, None

    def __enter__(self):
        if self.device is not None:
            self.previous = backend.cupy_module().cuda.runtime.getDevice() \
                if backend.device_count() > 0 else None
            cuda.set_device(self.device)
        return self

    def __exit__(self, *exc):
        if self.device is not None and self.previous is not None:
            cuda.set_device(self.previous)
        return False


def set_device_index(device, /):
    """Make GPU ``device`` (an index, "cuda:N" or a device) current for this thread, as
    torch.accelerator.set_device_index; where no GPU exists it raises ``cuda.set_device``'s error."""
    cuda.set_device(device.index if isinstance(device, hpcgrad_device) and device.index is not None
                    else device)


def current_device_index():
    """The current GPU's index, -1 where there is none."""
    return cuda.current_device()
