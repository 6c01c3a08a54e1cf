"""``%`` and ``//`` on tensors, both sides, as PyTorch's (values, dtypes, gradient)."""

import numpy as np
import pytest

import hpcgrad as hg

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("left, right", [
    ("x", "3"), ("x", "-2"), ("x", "2.5"), ("10", "x"), ("3.5", "x"), ("x", "y"),
])
@pytest.mark.parametrize("values", [[-7, 5, 9], [-7.5, 5.25, 9.0]])
@pytest.mark.parametrize("op", ["%", "//"])
def test_operators_as_torch(left, right, values, op):
    if op == "//" and "0" in (left, right):
        pytest.skip("no zero divisors")
    env_h = {"x": hg.tensor(values), "y": hg.tensor(values[::-1])}
    env_t = {"x": torch.tensor(values), "y": torch.tensor(values[::-1])}
    ours = eval(f"{left} {op} {right}", {}, env_h)
    theirs = eval(f"{left} {op} {right}", {}, env_t)
    assert str(ours.dtype) == str(theirs.numpy().dtype)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6)


def test_remainder_gradient_as_torch():
    x = hg.tensor([-7.5, 5.25, 9.0], requires_grad=True)
    t = torch.tensor([-7.5, 5.25, 9.0], requires_grad=True)
    (x % 2.0).sum().backward()
    (t % 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), t.grad.numpy())


def test_the_pipeline_examples_random_labels():
    labels = hg.LongTensor(64).random_() % 10
    assert labels.dtype == hg.long and 0 <= labels.array.min() and labels.array.max() < 10


def test_clamp_with_tensor_bounds_as_torch():
    values, bounds = [-2.0, 0.3, 1.7, 5.0], ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 2.0, 2.0])
    x, lo, hi = (hg.tensor(v, requires_grad=True) for v in (values, *bounds))
    tx, tlo, thi = (torch.tensor(v, requires_grad=True) for v in (values, *bounds))
    weights = [1.0, 2.0, 3.0, 4.0]
    (x.clamp(min=lo, max=hi) * hg.tensor(weights)).sum().backward()
    (tx.clamp(min=tlo, max=thi) * torch.tensor(weights)).sum().backward()
    for ours, theirs in ((x, tx), (lo, tlo), (hi, thi)):
        np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())
    np.testing.assert_array_equal(hg.clip(x, min=lo).detach().numpy(),
                                  torch.clip(tx, min=tlo).detach().numpy())
    np.testing.assert_array_equal(x.clamp(max=hi[:1]).detach().numpy(),  # broadcast
                                  tx.clamp(max=thi[:1]).detach().numpy())


def test_where_forms_as_torch():
    rows = [[True, False], [False, True]]
    c, tc = hg.tensor(rows), torch.tensor(rows)
    assert [t.tolist() for t in hg.where(c)] == [t.tolist() for t in torch.where(tc)]
    for a, b in ((1.0, 0.0), (1, 0)):
        ours, theirs = hg.where(c, a, b), torch.where(tc, a, b)
        assert str(ours.dtype) == str(theirs.numpy().dtype)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    with pytest.raises(TypeError, match="condition alone"):
        hg.where(c, 1.0)


def test_one_element_integer_tensors_are_indices_as_torch():
    data, tdata = hg.arange(10), torch.arange(10)
    starts, tstarts = hg.tensor([2, 5]), torch.tensor([2, 5])
    for i, ti in zip(starts, tstarts):  # iterating gives 0-d tensors, used as slice bounds
        np.testing.assert_array_equal(data[i:i + 3].numpy(), tdata[ti:ti + 3].numpy())
    assert list(range(hg.tensor(3))) == list(range(torch.tensor(3)))
    np.testing.assert_array_equal(np.arange(5)[hg.tensor([1, 3])], [1, 3])  # numpy takes it too
    for bad in (hg.tensor(2.0), hg.tensor([1, 2])):
        with pytest.raises(TypeError, match="only integer tensors of a single element"):
            range(bad)
