"""hpcgrad.device and the forms of Tensor.to / Module.to, as PyTorch's (issue 27)."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
from hpcgrad import backend


@pytest.mark.parametrize("args", [("cpu",), ("cuda",), ("cuda:1",), ("cuda", 2), ("cpu", 0)])
def test_device_forms_match_torch(args):
    torch = pytest.importorskip("torch")
    ours, theirs = hg.device(*args), torch.device(*args)
    assert ours.type == theirs.type
    if theirs.type == "cuda":  # "cuda" alone is the current GPU: cuda:0 on a rank's one GPU
        assert ours.index == (0 if theirs.index is None else theirs.index)
        assert ours == f"cuda:{ours.index}"
    else:  # one host: every CPU index names it, as a string too
        assert ours.index == theirs.index and ours == "cpu"
    assert hg.device(ours) is ours


def test_an_int_is_a_gpu_index():
    assert hg.device(3) == "cuda:3" and hg.device(3).index == 3


@pytest.mark.parametrize("bad, error", [("tpu", "Expected one of cpu, cuda device type"),
                                        ("cuda:x", "Invalid device string"),
                                        (("cuda:1", 1), "must not include an index")])
def test_device_errors(bad, error):
    with pytest.raises(RuntimeError, match=error):
        hg.device(*(bad if isinstance(bad, tuple) else (bad,)))


def test_a_device_is_its_string():
    assert hg.device("cpu") == "cpu" and hg.device("cuda", 1) == "cuda:1"
    assert repr(hg.device("cuda:1")) == "device(type='cuda', index=1)"
    assert {hg.device("cpu"): 1}["cpu"] == 1


def test_tensor_to_forms():
    x = hg.tensor(np.arange(3, dtype=np.float32), requires_grad=True)
    assert x.to(np.float32) is x and x.to("cpu") is x and x.to(hg.device("cpu")) is x
    y = x.to(hg.device("cpu"), np.float64)
    assert y.dtype == np.float64 and y.grad_fn is not None
    z = x.to(device="cpu", dtype="float16")
    assert z.dtype == np.float16
    other = hg.tensor(np.zeros(2, np.int64))
    assert x.to(other).dtype == np.int64
    (y * 2).sum().backward()
    assert x.grad.array.tolist() == [2.0, 2.0, 2.0]


def test_module_to_forms():
    model = nn.Linear(3, 2)
    weight = model.weight
    assert model.to(hg.device("cpu")) is model and model.weight is weight
    model.to("cpu", dtype=np.float64)
    assert model.weight.dtype == np.float64 and model.weight is weight
    with pytest.raises(TypeError, match="only accepts floating point or complex dtypes"):
        model.to(np.int32)


@pytest.mark.skipif(backend.device_count() > 0, reason="a GPU is present")
def test_a_gpu_index_without_a_gpu_is_an_error_not_a_dtype():
    """Before: Module.to(0) raised TypeError: Cannot interpret '0' as a data type."""
    with pytest.raises(RuntimeError, match="cuda:0"):
        nn.Linear(2, 2).to(0)
    assert hg.accelerator.is_available() is False
    assert hg.accelerator.current_accelerator() is None
