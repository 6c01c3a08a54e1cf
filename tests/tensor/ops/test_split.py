"""split's backward (tensor/ops/split.py): gradients already side by side in one array are joined
as a view; any other gradients are copied by a Cat, with the same values."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad as autograd_grad
from hpcgrad.tensor.ops import split
from hpcgrad.tensor.ops.split import _side_by_side


def _grads(*arrays):
    return [hg.tensor(a) if a is not None else None for a in arrays]


def _as_is(*arrays):
    """Tensors holding these very arrays (hg.tensor would copy them)."""
    from hpcgrad.tensor._tensor import Tensor
    return [Tensor._make(a, False, None, 0) for a in arrays]


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_pieces_side_by_side_are_joined_as_a_view(dim):
    cuts = {0: (1, 3), 1: (2, 3), 2: (1, 4)}[dim]
    pieces = np.split(np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5), cuts, axis=dim)
    joined = _side_by_side(_as_is(*pieces), dim)
    assert joined is not None and np.shares_memory(joined, pieces[0])
    np.testing.assert_array_equal(joined, np.concatenate(pieces, axis=dim))


def test_a_strided_owner_as_attentions_packed_gradients():
    """The GPT's case: (B, L, 3, H, E) viewed per piece as (B, L, H * E)."""
    owner = np.random.default_rng(0).standard_normal((2, 5, 3, 2, 4))
    pieces = [owner[:, :, i].reshape(2, 5, 8) for i in range(3)]
    del owner  # held by the pieces alone, as the gradients' owner is
    joined = _side_by_side(_as_is(*pieces), 2)
    assert joined is not None
    np.testing.assert_array_equal(joined, np.concatenate(pieces, axis=2))


def test_an_owner_someone_else_holds_is_not_viewed():
    """A view of the owner kept elsewhere (a hook's kept gradient): copied, so that writing the
    joined gradient cannot change what was kept."""
    owner = np.arange(24.0).reshape(4, 6)
    pieces = [owner[:, :3], owner[:, 3:]]
    del owner
    assert _side_by_side(_as_is(*pieces), 1) is not None
    kept = pieces[0].base[:1]  # noqa: F841  (held: the owner has one more view)
    assert _side_by_side(_as_is(*pieces), 1) is None


def test_anything_else_is_not_a_view():
    def pieces(*cuts):
        owner = np.arange(24.0).reshape(4, 6)
        return [owner[:, a:b] for a, b in cuts]
    assert _side_by_side(_as_is(*pieces((1, 3), (3, 4))), 1) is not None
    assert _side_by_side(_as_is(*pieces((0, 2), (4, 6))), 1) is None  # a gap between them
    assert _side_by_side(_as_is(*pieces((2, 4), (0, 2))), 1) is None  # out of order
    assert _side_by_side(_as_is(*pieces((0, 2), (0, 2))), 1) is None  # the same piece twice
    a, b = pieces((0, 2), (2, 4))
    assert _side_by_side(_as_is(a, np.ascontiguousarray(b)), 1) is None  # another array
    a, b = pieces((0, 3), (3, 6))
    assert _side_by_side(_as_is(a, b.astype(np.float32)), 1) is None  # dtypes
    assert _side_by_side(_grads(a, None), 1) is None  # a piece without a gradient
    flat = np.arange(24.0)  # adjacent addresses, but strides that differ
    first, second = flat[:12].reshape(3, 4), flat[12:].reshape(4, 3)[:, :2]
    del flat
    assert _side_by_side(_as_is(first, second), 0) is None


def test_split_backward_joins_or_copies_with_the_same_values(monkeypatch):
    """A split whose pieces' gradients come from one array (a custom Function writes them
    side by side) and one whose do not: the same input gradient, a Cat only for the second."""
    cats, cat = [], split.Cat.apply
    monkeypatch.setattr(split.Cat, "apply", staticmethod(lambda *args: cats.append(1) or
                                                         cat(*args)))
    rng = np.random.default_rng(1)
    x = hg.tensor(rng.standard_normal((3, 6)), requires_grad=True)
    w = rng.standard_normal((3, 6))

    class Together(hg.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return a + b + c

        @staticmethod
        def backward(ctx, g):
            every = np.empty((3, 6))
            every[:, :2], every[:, 2:4], every[:, 4:] = g.numpy(), 2 * g.numpy(), 3 * g.numpy()
            return tuple(_as_is(every[:, :2], every[:, 2:4], every[:, 4:]))

    a, b, c = x.split(2, dim=1)
    (Together.apply(a, b, c) * hg.tensor(w[:, :2])).sum().backward()
    assert not cats
    want = np.concatenate([w[:, :2], 2 * w[:, :2], 3 * w[:, :2]], axis=1)
    np.testing.assert_allclose(x.grad.numpy(), want)
    x.grad = None
    (a * hg.tensor(w[:, :2]) + b * hg.tensor(w[:, 2:4])).sum().backward()
    assert cats
    np.testing.assert_allclose(x.grad.numpy(), np.concatenate([w[:, :4], np.zeros((3, 2))], 1))


def test_under_create_graph_the_join_is_a_differentiable_cat():
    x = hg.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    a, b = x.split([1, 2], dim=1)
    (gx,) = autograd_grad((a * a).sum() + (b * b * b).sum(), [x], create_graph=True)
    assert gx.grad_fn is not None
    xs = x.detach().numpy()
    np.testing.assert_allclose(gx.detach().numpy(), np.concatenate([2 * xs[:, :1],
                                                                    3 * xs[:, 1:] ** 2], 1))
