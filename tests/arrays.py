"""One parametrization over the array modules (numpy, cupy), as mpi4py's test/arrayimpl.py.

A test asks for the ``xp`` fixture and runs once per module: ``xp.asarray`` / ``xp.zeros`` /
``xp.tensor`` make data on that module's device, ``xp.numpy`` brings any result back to numpy
for comparison with a reference computed on the host. The cupy case is marked ``gpu`` (so
``-m gpu`` selects it and conftest.py skips it when no GPU answers) and is skipped with a reason
when cupy is not importable.

Import the fixture into a test module with ``from arrays import xp_fixture  # noqa: F401``; tests
name it ``xp`` (the attribute has another name so that linters see no redefinition).
"""

import numpy as np
import pytest

from hpcgrad import backend
from hpcgrad.comm.mpi import comm_world
from hpcgrad.tensor import Tensor

_NO_CUPY = "cupy is not installed (pip install -e '.[cuda12]' or '.[cuda13]')"


class ArrayModule:
    """numpy or cupy, with the few helpers the tests need to stay module-agnostic."""

    def __init__(self, name):
        self.name = name
        if name == "numpy":
            self.module, self.device = np, backend.CPU
            return
        cupy = backend.cupy_module()
        if cupy is None:  # the skipif mark normally stops us first
            pytest.skip(_NO_CUPY)
        if backend.device_count() == 0:
            pytest.skip("needs a CUDA GPU: cupy.is_available() is False")
        # A rank uses one GPU (ranks of a node share them round-robin, as the README says).
        index = comm_world().Get_rank() % backend.device_count()
        backend.use_device(index)
        self.module, self.device = cupy, f"cuda:{index}"

    def __repr__(self):
        return f"ArrayModule({self.name!r} on {self.device})"

    @property
    def is_gpu(self):
        return self.device != backend.CPU

    # --- making data on this module ------------------------------------------------------------
    def asarray(self, array, dtype=None):
        """A copy of host ``array`` on this module (numpy: a copy, so tests may write to it)."""
        host = np.array(array, dtype=dtype, copy=True)
        return host if not self.is_gpu else backend.to_device(host, self.device)

    def zeros(self, shape, dtype=np.float64):
        return backend.zeros(shape, np.dtype(dtype), self.device)

    def tensor(self, array, requires_grad=False, dtype=None):
        """An hpcgrad Tensor on this module holding a copy of ``array``."""
        return Tensor(self.asarray(array, dtype), requires_grad=requires_grad)

    # --- reading results back ------------------------------------------------------------------
    def numpy(self, x):
        """``x`` (array or Tensor, on either module) as a numpy array, after checking it lives here."""
        data = x.array if isinstance(x, Tensor) else x
        assert backend.device_of(data) == self.device, \
            f"expected an array on {self.device}, got one on {backend.device_of(data)}"
        return backend.to_device(data, backend.CPU)

    def synchronize(self):
        """Wait for this device's queued work (nothing to do on the CPU)."""
        if self.is_gpu:
            self.module.cuda.get_current_stream().synchronize()


MODULES = [
    pytest.param("numpy", id="numpy"),
    pytest.param("cupy", id="cupy", marks=[
        pytest.mark.gpu, pytest.mark.skipif(backend.cupy_module() is None, reason=_NO_CUPY)]),
]


@pytest.fixture(params=MODULES, name="xp")
def xp_fixture(request):
    """The array module a test runs on: numpy, then cupy (GPU; skipped without one)."""
    return ArrayModule(request.param)
