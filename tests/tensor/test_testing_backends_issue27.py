"""torch.testing.assert_close, torch.backends flags, tan, nn.init.orthogonal_ and the
torch.utils.data.sampler path, beside PyTorch's."""

import numpy as np
import pytest

import hpcgrad as hg

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64"])
@pytest.mark.parametrize("scale", [0.0, 1e-8, 1e-6, 1e-4, 1e-2])
def test_assert_close_decides_as_torch(dtype, scale):
    base = np.linspace(0.5, 2.0, 6)
    values = (base, base * (1 + scale) + (1 if dtype == "int64" and scale else 0))
    ours = [hg.tensor(v.astype(dtype)) for v in values]
    theirs = [torch.tensor(v.astype(dtype)) for v in values]

    def verdict(fn, a, b):
        try:
            fn(a, b)
            return True
        except AssertionError:
            return False

    assert verdict(hg.testing.assert_close, *ours) == verdict(torch.testing.assert_close, *theirs)


def test_assert_close_messages_and_arguments():
    with pytest.raises(AssertionError, match="Tensor-likes are not close!"):
        hg.testing.assert_close(hg.ones(3), hg.zeros(3))
    with pytest.raises(AssertionError, match="'dtype' do not match"):
        hg.testing.assert_close(hg.ones(3), hg.ones(3, dtype=hg.float64))
    with pytest.raises(AssertionError, match="'shape' do not match"):
        hg.testing.assert_close(hg.ones(3), hg.ones(2))
    with pytest.raises(ValueError, match="Both 'rtol' and 'atol'"):
        hg.testing.assert_close(hg.ones(3), hg.ones(3), rtol=1e-3)
    hg.testing.assert_close([hg.ones(2), 1.0], [hg.ones(2), 1.0])
    hg.testing.assert_close(hg.ones(2), hg.ones(2) * 1.01, rtol=0.05, atol=0.0)


def test_tan_as_torch():
    x, t = hg.tensor([-1.0, 0.3, 1.2], requires_grad=True), torch.tensor([-1.0, 0.3, 1.2],
                                                                          requires_grad=True)
    hg.tan(x).sum().backward()
    torch.tan(t).sum().backward()
    np.testing.assert_allclose(x.tan().detach().numpy(), t.tan().detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (3, 2, 2)])
def test_orthogonal_init(shape):
    w = hg.nn.init.orthogonal_(hg.empty(*shape), gain=2.0).numpy().reshape(shape[0], -1)
    small = w @ w.T if shape[0] <= w.shape[1] else w.T @ w
    np.testing.assert_allclose(small, 4 * np.eye(len(small)), atol=1e-5)
    with pytest.raises(ValueError, match="Only tensors with 2 or more dimensions"):
        hg.nn.init.orthogonal_(hg.empty(3))


def test_backends_flags_and_sampler_path():
    hg.backends.cudnn.benchmark = True
    hg.backends.cudnn.deterministic = True
    assert hg.backends.cudnn.is_available() is False
    from hpcgrad.utils.data.sampler import RandomSampler, Sampler
    assert issubclass(RandomSampler, Sampler)
