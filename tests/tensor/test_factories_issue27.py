"""PyTorch's dtype names, factory arguments (dtype=, device=, requires_grad=) and the
everyday conversion methods, each beside PyTorch's own result."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import backend

torch = pytest.importorskip("torch")

NAMES = ["float32", "float", "float64", "double", "float16", "half", "int64", "long", "int32",
         "int", "int16", "short", "int8", "uint8", "bool", "complex64", "cfloat", "complex128",
         "cdouble"]


@pytest.mark.parametrize("name", NAMES)
def test_dtype_names_are_pytorchs(name):
    ours, theirs = getattr(hg, name), getattr(torch, name)
    made = hg.zeros(2, dtype=ours)
    assert made.dtype == ours
    assert str(torch.zeros(2, dtype=theirs).numpy().dtype) == str(made.dtype)
    assert hg.ones(3).to(ours).dtype == ours


def test_builtins_are_not_shadowed_inside_hpcgrad():
    import builtins
    assert hg.bool is not builtins.bool and bool is builtins.bool
    assert hg.tensor([True]).dtype == hg.bool and hg.tensor([1.5]).dtype == hg.float


@pytest.mark.parametrize("call", [
    "zeros(2, 3, dtype={lib}.long)", "ones((2,), dtype={lib}.float64)", "full((2, 2), 3)",
    "full((2,), 2.5)", "full((2,), True)", "empty(4, dtype={lib}.int32).shape", "eye(3, 2)",
    "arange(5)", "arange(0, 1, 0.25)", "arange(4, dtype={lib}.float64)", "linspace(0, 1, 5)",
    "tensor([1, 2], dtype={lib}.int16)", "tensor(3.0)", "tensor([[1, 2]], dtype={lib}.float)",
    "zeros_like({lib}.ones(2, 3), dtype={lib}.bool)", "ones_like({lib}.zeros(2, dtype={lib}.int64))",
    "full_like({lib}.zeros(3), 7)", "empty_like({lib}.zeros(2, 2)).shape",
    "as_tensor([1.5, 2.5], dtype={lib}.float64)", "is_tensor({lib}.ones(1))", "numel({lib}.ones(2, 5))",
])
def test_factories_as_torch(call):
    ours = eval("hg." + call.format(lib="hg"))
    theirs = eval("torch." + call.format(lib="torch"))
    if isinstance(theirs, torch.Tensor):
        assert str(ours.dtype) == str(theirs.numpy().dtype), call
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    else:
        assert tuple(ours) == tuple(theirs) if isinstance(theirs, tuple) else ours == theirs


@pytest.mark.parametrize("name", ["zeros", "ones", "empty", "randn", "rand"])
def test_factories_take_device_and_requires_grad(name):
    made = getattr(hg, name)(2, 3, dtype=hg.float64, device=hg.device("cpu"), requires_grad=True)
    assert made.shape == (2, 3) and made.dtype == hg.float64 and made.device == "cpu"
    assert made.requires_grad and made.is_leaf
    assert getattr(hg, name)(2, device="cpu", pin_memory=False).dtype == hg.float32


def test_randint_forms_and_generators():
    a = hg.randint(5, (200,))
    b = hg.randint(3, 5, (200,), dtype=hg.int32)
    assert a.dtype == hg.int64 and 0 <= a.array.min() and a.array.max() < 5
    assert b.dtype == hg.int32 and 3 <= b.array.min() and b.array.max() < 5
    g1, g2 = np.random.default_rng(7), np.random.default_rng(7)
    np.testing.assert_array_equal(hg.randn(4, generator=g1).numpy(), hg.randn(4, generator=g2).numpy())
    assert sorted(hg.randperm(6).tolist()) == list(range(6))
    with pytest.raises(TypeError, match="randint\\(\\) takes"):
        hg.randint(1, 2, 3, (4,))


@pytest.mark.skipif(backend.device_count() > 0, reason="checks the error where no GPU exists")
def test_a_cuda_device_where_none_exists_gives_pytorchs_error():
    phrase = ("Torch not compiled with CUDA enabled" if backend.cupy_module() is None
              else "No CUDA GPUs are available")
    with pytest.raises(RuntimeError, match=phrase):
        hg.zeros(2, device="cuda")
    with pytest.raises(RuntimeError, match=phrase):
        hg.ones(2).to("cuda:0")
    with pytest.raises(RuntimeError, match=phrase):
        hg.tensor([1.0], device=hg.device("cuda", 0))


@pytest.mark.parametrize("method", ["int", "short", "char", "byte", "bool", "float", "double",
                                    "half", "long"])
def test_conversion_methods(method):
    x = hg.tensor([[0.0, 1.5], [-2.0, 3.0]])
    t = torch.tensor([[0.0, 1.5], [-2.0, 3.0]])
    ours, theirs = getattr(x, method)(), getattr(t, method)()
    assert str(ours.dtype) == str(theirs.numpy().dtype)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_facts_about_memory_as_torch():
    x, t = hg.zeros(3, 4), torch.zeros(3, 4)
    assert x.stride() == t.stride() and x.T.stride() == t.T.stride() and x.stride(1) == t.stride(1)
    assert x.element_size() == t.element_size() and x.nelement() == t.nelement()
    assert x.nbytes == t.nbytes and x.itemsize == t.itemsize
    assert x.is_cuda is False and x.is_cpu and x.is_floating_point()
    assert not x.long().is_floating_point()
    assert x.type() == t.type() == "torch.FloatTensor" and x.long().type() == t.long().type()
    assert x.type(hg.float64).dtype == hg.float64
    assert x.data_ptr() == x.array.__array_interface__["data"][0]


@pytest.mark.parametrize("call", [
    "new_zeros(2, 3)", "new_ones((2,))", "new_full((2,), 5)", "new_empty(3).shape",
    "new_tensor([1, 2])", "new_zeros(2, dtype={lib}.int64)",
])
def test_new_factories_keep_dtype_and_device(call):
    x, t = hg.zeros(1, dtype=hg.float64), torch.zeros(1, dtype=torch.float64)
    ours = eval("x." + call.format(lib="hg"))
    theirs = eval("t." + call.format(lib="torch"))
    if isinstance(theirs, torch.Tensor):
        assert str(ours.dtype) == str(theirs.numpy().dtype), call
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    else:
        assert tuple(ours) == tuple(theirs)


def test_default_dtype():
    assert hg.get_default_dtype() == hg.float32 and torch.get_default_dtype() == torch.float32
    hg.set_default_dtype(hg.float32)
    with pytest.raises(NotImplementedError, match="fixed at float32"):
        hg.set_default_dtype(hg.float64)


def test_compile_returns_the_model_which_computes_the_same():
    net = hg.nn.Linear(3, 2)
    x = hg.randn(4, 3)
    assert hg.compile(net) is net
    np.testing.assert_array_equal(hg.compile(net, mode="max-autotune")(x).detach().numpy(),
                                  net(x).detach().numpy())

    @hg.compile(fullgraph=True)
    def double(t):
        return t * 2

    np.testing.assert_array_equal(double(x).numpy(), (x * 2).numpy())
    with pytest.raises(RuntimeError, match="expected a Module or a function"):
        hg.compile(3)


def test_size_as_torch():
    ours, theirs = hg.Size([2, 3, 4]), torch.Size([2, 3, 4])
    assert ours == theirs == (2, 3, 4) and ours.numel() == theirs.numel() == 24
    assert repr(ours) == repr(theirs) and hg.zeros(ours).shape == ours
    assert hg.Size([]).numel() == torch.Size([]).numel() == 1
