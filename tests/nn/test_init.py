"""nn.init and layers' default initialisation: seeded, with PyTorch's bounds and gains."""

import math

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
from hpcgrad.nn import init


def _fresh(*shape):
    return nn.Parameter(hg.zeros(*shape, dtype=np.float64))


@pytest.mark.parametrize("make", [lambda: nn.Linear(7, 5), lambda: nn.Conv2d(3, 4, (2, 3)),
                                  lambda: nn.Embedding(6, 2), lambda: nn.LayerNorm(3)])
def test_manual_seed_makes_layers_reproducible(make):
    hg.manual_seed(11)
    a = make().state_dict()
    hg.manual_seed(11)
    b = make().state_dict()
    for key in a:
        np.testing.assert_array_equal(a[key].array, b[key].array)


@pytest.mark.parametrize("make, fan_in", [(lambda: nn.Linear(300, 200), 300),
                                          (lambda: nn.Conv2d(8, 64, 5), 8 * 25)])
def test_default_init_bounds_like_torch(make, fan_in):
    hg.manual_seed(0)
    layer = make()
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), ..)
    for p in (layer.weight, layer.bias):
        assert np.abs(p.array).max() <= bound
    assert np.abs(layer.weight.array).max() > 0.98 * bound
    assert layer.weight.dtype == np.float32


@pytest.mark.parametrize("fill, expected_std", [
    (lambda t: init.kaiming_uniform_(t), math.sqrt(2 / (1 + 0.01 ** 2)) / math.sqrt(400)),
    (lambda t: init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
     math.sqrt(2) / math.sqrt(300)),
    (lambda t: init.xavier_uniform_(t, gain=2.0), 2 * math.sqrt(2 / 700)),
    (lambda t: init.xavier_normal_(t), math.sqrt(2 / 700)),
    (lambda t: init.normal_(t, 1.0, 0.5), 0.5),
    (lambda t: init.uniform_(t, -1, 3), 4 / math.sqrt(12)),
    (lambda t: init.trunc_normal_(t, std=2.0, a=-1.0, b=1.0), None),
])
def test_random_fills_have_the_right_spread(fill, expected_std):
    hg.manual_seed(5)
    t = fill(_fresh(300, 400))
    if expected_std is None:
        assert -1.0 <= t.array.min() and t.array.max() <= 1.0
    else:
        assert abs(t.array.std() / expected_std - 1) < 0.02
    hg.manual_seed(5)
    np.testing.assert_array_equal(fill(_fresh(300, 400)).array, t.array)


def test_constants_gain_fans_and_generator():
    t = _fresh(2, 3, 4, 5)
    assert init._calculate_fan_in_and_fan_out(t) == (60, 40)
    assert init.ones_(t) is t and (t.array == 1).all()
    assert (init.zeros_(t).array == 0).all() and (init.constant_(t, 2.5).array == 2.5).all()
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.xavier_uniform_(_fresh(4))
    a = init.normal_(_fresh(3), generator=np.random.default_rng(1)).array
    b = init.normal_(_fresh(3), generator=np.random.default_rng(1)).array
    np.testing.assert_array_equal(a, b)
    torch = pytest.importorskip("torch")
    for args in [("linear",), ("relu",), ("tanh",), ("leaky_relu",), ("leaky_relu", 0.2),
                 ("selu",), ("conv2d",)]:
        assert init.calculate_gain(*args) == pytest.approx(torch.nn.init.calculate_gain(*args))
