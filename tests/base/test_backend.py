"""Array-module dispatch: numpy on the CPU; cupy paths import and skip cleanly without a GPU."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import backend


def test_cpu_arrays_dispatch_to_numpy():
    a = np.ones(3)
    assert backend.get_array_module(a) is np
    assert backend.device_of(a) == "cpu" and backend.device_index("cpu") == -1
    assert backend.to_device(a, "cpu") is a
    assert hg.tensor([1.0]).device == "cpu"


def test_moving_to_a_gpu_without_cupy_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", None)
    assert backend.device_count() == 0
    with pytest.raises(RuntimeError, match=r"cupy is not installed.*hpcgrad\[cuda12\]"):
        backend.to_device(np.ones(2), "cuda:0")


@pytest.mark.gpu
def test_gpu_backward_matches_cpu():
    x_cpu = hg.tensor(np.linspace(-1, 1, 6).reshape(2, 3), requires_grad=True)
    x_gpu = x_cpu.detach().cuda().requires_grad_()
    for x in (x_cpu, x_gpu):
        (x.tanh() * 2.0).sum().backward()
    assert x_gpu.grad.device == "cuda:0"
    np.testing.assert_allclose(x_gpu.grad.cpu().numpy(), x_cpu.grad.numpy(), rtol=1e-12)


def test_zeros_on_a_device():
    assert backend.zeros((2, 3), np.float32).dtype == np.float32
    assert not backend.zeros((2,), np.float64).any()
    if backend.cupy_module() is None:
        with pytest.raises(RuntimeError, match="cupy is not installed"):
            backend.zeros((2,), np.float32, "cuda:0")
