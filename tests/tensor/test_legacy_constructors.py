"""torch.LongTensor-style constructors (issue 27: pytorch/examples' rpc scripts use them)."""

import numpy as np
import pytest

import hpcgrad as hg

NAMES = ["FloatTensor", "DoubleTensor", "HalfTensor", "LongTensor", "IntTensor", "ShortTensor",
         "CharTensor", "ByteTensor", "BoolTensor"]


@pytest.mark.parametrize("name", NAMES)
def test_from_data_and_from_sizes_match_torch(name):
    torch = pytest.importorskip("torch")
    data = [[1, 0, 3], [0, 5, 1]]
    ours, theirs = getattr(hg, name)(data), getattr(torch, name)(data)
    assert str(ours.dtype) == str(theirs.dtype).replace("torch.", "").replace("bool", "bool")
    assert ours.array.tolist() == theirs.tolist()
    shaped = getattr(hg, name)(2, 3)
    assert shaped.shape == tuple(getattr(torch, name)(2, 3).shape)
    assert isinstance(ours, getattr(hg, name)) and isinstance(ours, hg.Tensor)
    other = "FloatTensor" if name != "FloatTensor" else "LongTensor"
    assert not isinstance(ours, getattr(hg, other))


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"LongTensor\(\): expected data"):
        hg.LongTensor(2, -1)
    assert hg.LongTensor(np.arange(3)).array.tolist() == [0, 1, 2]
