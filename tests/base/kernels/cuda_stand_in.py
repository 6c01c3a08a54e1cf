"""What the CUDA kernels' tests share: their simulator run in a subprocess, and numpy arrays the
wrappers take for cupy ones (there is no cupy without a GPU)."""

import contextlib
import sys
import types

import numpy as np
import pytest

from hpcgrad.base import backend


class FakeCupyArray(np.ndarray):
    """A numpy array that ``backend.is_gpu_array`` calls a cupy one inside ``stand_in_cupy``."""


@contextlib.contextmanager
def stand_in_cupy():
    """FakeCupyArray is a cupy array to the wrappers, while kernels/cuda.py's views of it stay
    numpy's (what the simulator launches on); yields ``fake(a)``, a's view as one."""
    from hpcgrad.base.kernels import cuda as cuda_module
    real = backend.is_gpu_array
    backend.is_gpu_array = lambda a: isinstance(a, FakeCupyArray)
    cuda_module.backend = types.SimpleNamespace(is_gpu_array=lambda a: False)
    try:
        yield lambda a: a.view(FakeCupyArray)
    finally:
        backend.is_gpu_array = real
        cuda_module.backend = backend


def run_under_simulator(launch, path, setting):
    """``python path`` with NUMBA_ENABLE_CUDASIM=1 (numba reads it at import, hence a
    subprocess) and ``setting``=1, which must print "all cases passed"."""
    pytest.importorskip("numba.cuda")
    job = launch([sys.executable, path], env={"NUMBA_ENABLE_CUDASIM": "1", setting: "1"},
                 timeout=300)
    assert not job.failed, job.output
    assert "all cases passed" in job.stdout
