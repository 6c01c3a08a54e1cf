"""hpcgrad.cuda without a GPU, and the engine starting device threads only for devices in use."""

import pytest

import hpcgrad as hg
import hpcgrad.cuda
from hpcgrad import backend
from hpcgrad.autograd import engine as engine_module
from hpcgrad.autograd.engine import Engine


def test_without_a_gpu_the_calls_answer_plainly(monkeypatch):
    monkeypatch.setattr(backend, "device_count", lambda: 0)
    assert not hpcgrad.cuda.is_available() and hpcgrad.cuda.device_count() == 0
    with pytest.raises(RuntimeError, match=r"set_device\(0\): no such GPU"):
        hpcgrad.cuda.set_device(0)


@pytest.mark.parametrize("bad", [-1, "device0", 1.5, True])
def test_set_device_refuses_nonsense(bad):
    with pytest.raises((ValueError, IndexError)):
        hpcgrad.cuda.set_device(bad)


def test_set_device_selects_the_device(monkeypatch):
    used = []
    monkeypatch.setattr(backend, "device_count", lambda: 4)
    monkeypatch.setattr(backend, "use_device", used.append)
    hpcgrad.cuda.set_device("cuda:2")
    hpcgrad.cuda.set_device(3)
    assert used == [2, 3]


def test_a_cpu_backward_starts_no_device_thread(monkeypatch):
    """Every visible GPU got a worker thread (and so a CUDA context) in every rank; now a
    device's thread starts with its first work, and CPU work never starts one."""
    used = []
    monkeypatch.setattr(backend, "device_count", lambda: 4)
    monkeypatch.setattr(backend, "use_device", used.append)
    engine = Engine()
    monkeypatch.setattr(engine_module, "_default_engine", engine)
    x = hg.tensor([1.0, 2.0], requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.array.tolist() == [2.0, 4.0]
    assert used == [] and engine._device_queues == {}
    assert engine.ready_queue(None, 1) is engine.ready_queue(None, 1)  # started once, on use
    assert list(engine._device_queues) == [1]
