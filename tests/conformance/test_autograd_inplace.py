"""Ports of PyTorch's TestAutograd in-place, version-counter and view tests (test/test_autograd.py).

Each test says which PyTorch test it ports; the expected values are PyTorch's (hand-computed
there), the gradchecks compare with finite differences. Where hpcgrad differs on purpose the
test says so. Left out, and why:

- test_version_counter's ``x.data = y`` half: a version belongs to the memory here (Note [Version
  counters on memory]), so a tensor given new data gets that data's version, not its old one;
- test_inplace_not_requires_grad's views returned by a custom Function ("This view was created
  inside a custom Function"): such outputs are not recorded as views;
- views made under no_grad being modified with grad on ("A view was created in no_grad mode"):
  views made under no_grad are not recorded (they share the version counter only);
- ``detach_`` and ``_saved_result``-style attributes of Nodes (not built);
- the sparse halves of test_accumulate_grad_tensor_reference (torch.sparse_coo_tensor).
"""

import gc
import math

import numpy as np
import pytest
from autograd_helpers import assert_close, leaf, ones, randn, zeros

import hpcgrad as hg
from hpcgrad.autograd import Function, gradcheck, gradgradcheck, no_grad

MODIFIED = "modified by an inplace operation"


# --- version counters ---------------------------------------------------------------------------

def test_version_counter():
    """test_version_counter (without ``x.data = y``: the version here belongs to the memory)."""
    x = randn(1, 2, requires_grad=False)
    before = x._version
    x.add_(1).add_(1)
    assert x._version > before
    xz = x[:]  # a view shares the counter
    assert x._version == xz._version
    xz.add_(1)
    assert x._version == xz._version
    assert x._version == before + 3


def test_saved_variable_version_counter():
    """test_saved_variable_version_counter: a saved output unpacked shares the output's counter."""
    a = randn(2)
    b = a.exp()
    unpacked = b.grad_fn.saved_tensors[0]
    assert_close(b, unpacked)
    assert b._version == unpacked._version
    with no_grad():
        b += 1
    assert_close(b, unpacked)
    assert b._version == unpacked._version


def test_no_grad_modifies_version():
    """test_no_grad_modifies_version: a write under no_grad still invalidates saved tensors."""
    x, y = randn(5, seed=1), randn(5, seed=2)
    z = (x * y).sum()
    with no_grad():
        x *= 2
    with pytest.raises(RuntimeError, match=MODIFIED):
        z.backward()


def test_inplace():
    """test_inplace: which backwards a write breaks (those that saved the written tensor)."""
    x = ones(5, 5, requires_grad=True)
    y = leaf(np.ones((5, 5)) * 4)
    z = x * y
    q = z + y
    w = z * y
    z.add_(2)
    q.backward(ones(5, 5), retain_graph=True)  # Add saved nothing
    with pytest.raises(RuntimeError, match=MODIFIED):
        w.backward(ones(5, 5))  # Mul saved z

    z = x * y
    q = z * y
    r = z + y
    w = z.add_(y)
    w.backward(ones(5, 5), retain_graph=True)  # the last expression
    r.backward(ones(5, 5), retain_graph=True)  # does not use z's value
    with pytest.raises(RuntimeError, match=MODIFIED):
        q.backward(ones(5, 5))

    with no_grad():
        x.grad.zero_()
    m = x / 2
    z = m + y / 8
    q = z * y
    r = z + y
    prev_version = z._version
    w = z.exp_()
    assert z._version != prev_version
    r.backward(ones(5, 5), retain_graph=True)
    assert_close(x.grad, np.ones((5, 5)) / 2)
    w.backward(ones(5, 5), retain_graph=True)
    assert_close(x.grad, np.full((5, 5), (1 + math.e) / 2))
    with pytest.raises(RuntimeError, match=MODIFIED):
        q.backward(ones(5, 5))

    root = ones(5, 5, requires_grad=True)
    x = root.clone()
    x.add_(10)
    assert_close(x, np.full((5, 5), 11.0))
    y = x + 2  # x is still usable
    y.backward(ones(5, 5))
    assert_close(root.grad, np.ones((5, 5)))
    z = x * y
    x.add_(2)
    with pytest.raises(RuntimeError, match=MODIFIED):
        z.backward(ones(5, 5))


def test_inplace_error_message_names_version_and_node():
    """The error names dtype, shape, the Node and both versions, as PyTorch's."""
    a = randn(3).clone()
    b = a.sigmoid()  # saves its output b
    b.mul_(2)
    with pytest.raises(RuntimeError) as info:
        b.sum().backward()
    text = str(info.value)
    assert "[float64 [3]], which is output 0 of SigmoidBackward0" in text
    assert "is at version 1; expected version 0 instead. Hint:" in text


# --- leaves ------------------------------------------------------------------------------------

def test_leaf_inplace_raises_and_no_grad_allows():
    """check_inplace: a leaf that requires grad cannot be written with grad on; under no_grad it can."""
    x = randn(3)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in "
                                            "an in-place operation."):
        x.add_(1)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        x[0] = 1.0
    with no_grad():
        x.mul_(2)
        x[0] = 5.0
    assert x._version == 2
    assert x.is_leaf and x.requires_grad


def test_leaf_assignment():
    """test_leaf_assignment: writing tensors that require grad into a leaf that does not."""
    x = zeros(5, 5)
    y, z = randn(5, seed=1), randn(5, seed=2)
    x[0] = y
    x[1] = 2 * z
    assert x.requires_grad and x.grad_fn is not None
    x.sum().backward()
    assert_close(y.grad, np.ones(5))
    assert_close(z.grad, np.full(5, 2.0))


def test_no_grad_assignment():
    """test_no_grad_assignment: under no_grad a leaf that requires grad stays a leaf."""
    x = randn(5, 5)
    y = randn(5, requires_grad=False, seed=3)
    with no_grad():
        x[0] = y
    assert x.requires_grad and x.grad_fn is None
    assert_close(x[0].detach(), y)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_accumulate_grad_tensor_reference():
    """test_accumulate_grad_tensor_reference (dense): .grad is kept (added into) without
    create_graph, replaced with it."""
    for create_graph in (False, True):
        params = leaf([1.5, 1.5])
        params.grad = leaf([1.5, 1.5], requires_grad=False)
        saved = params.grad
        params.backward(leaf([1.5, 1.5], requires_grad=False), create_graph=create_graph)
        assert (params.grad is saved) == (not create_graph)


# --- __setitem__ -------------------------------------------------------------------------------

def _index_grad(size, index):
    expected = np.ones(size)
    expected[index] = 0
    return expected


@pytest.mark.parametrize("size,index", [
    ((5, 5), 1), ((5,), 1), ((1,), 0), ((10,), ([0, 4, 2],)), ((5, 5), ([0, 4], [2, 2])),
    ((5, 5, 5), (slice(None), slice(None), [1, 3])), ((5, 5, 5), (slice(None), [1, 3], slice(None))),
    ((5, 5, 5), ([1, 3], slice(None), slice(None))), ((5, 5, 5), (slice(None), [2, 4], [1, 3])),
    ((5, 5, 5), ([1, 3], [2, 4], slice(None))), ((5, 5), (slice(1, 3), Ellipsis)),
])
def test_setitem(size, index):
    """test_setitem: a number written at an index; the input's gradient is 0 there."""
    x = randn(*size)
    y = x + 2
    version = y._version
    y[index] = 2
    assert y._version != version
    y.backward(ones(*size))
    assert_close(x.grad, _index_grad(size, index))


@pytest.mark.parametrize("size,index", [
    ((5, 5), 3), ((5, 5), ([0, 1], [1, 0])), ((5,), 3), ((5,), ([0, 1, 2, 3],)),
    ((5, 5, 5), (slice(None), slice(None), [1, 3])), ((5, 5, 5), (slice(None), [1, 3], slice(None))),
    ((5, 5, 5), ([1, 3], slice(None), slice(None))), ((5, 5, 5), (slice(None), [2, 4], [1, 3])),
    ((5, 5, 5), ([1, 3], [2, 4], slice(None))),
])
def test_setitem_tensor(size, index):
    """test_setitem (tensor values): the value gets the gradient of where it went."""
    x = randn(*size)
    y = x + 2
    value = randn(*np.empty(size)[index].shape, seed=4)
    y[index] = value
    y.backward(ones(*size))
    assert_close(x.grad, _index_grad(size, index))
    assert_close(value.grad, np.ones(value.shape))


def test_setitem_mask():
    """test_setitem_mask: boolean-mask indices, number and tensor values."""
    mask = np.random.default_rng(0).random((5, 5)) > 0.5
    for size, m in (((5, 5), mask), ((5,), mask[0]), ((1,), mask[0, 0:1])):
        x = randn(*size)
        y = x + 2
        y[hg.tensor(m)] = 2
        y.backward(ones(*size))
        assert_close(x.grad, _index_grad(size, m))
    x = randn(5, 5)
    y = x + 2
    value = randn(int(mask.sum()), seed=5)
    y[mask] = value
    y.backward(ones(5, 5))
    assert_close(x.grad, _index_grad((5, 5), mask))
    assert_close(value.grad, np.ones(value.shape))


def test_setitem_scalar_tensor_index():
    """A 0-d integer tensor as the index, as PyTorch's ``LongTensor([3]).sum()``."""
    x = randn(5)
    y = x + 2
    value = randn(seed=6)  # 0-d
    y[hg.tensor(np.array(3))] = value
    y.backward(ones(5))
    assert_close(x.grad, [1, 1, 1, 0, 1])
    assert_close(value.grad, 1.0)


# --- views ---------------------------------------------------------------------------------------

def test_views_share_base_and_version():
    x = randn(4, 4).clone()
    for v in (x[1:], x.view(16), x.t(), x.transpose(0, 1), x.permute(1, 0), x.narrow(0, 1, 2),
              x.select(1, 0), x.unsqueeze(0), x[None].squeeze(0), x[:1].expand(3, 4)):
        assert v._is_view() and v._base is x
    assert x[1:][1:]._base is x  # the first base, never a view
    assert not x._is_view() and x._base is None
    v = x[1]
    v.add_(1)
    assert v._version == x._version == 1


def test_inplace_on_view_leaf_errors():
    """test_inplace_on_view_leaf_errors."""
    x = zeros(1, requires_grad=True)
    y = x.view(1)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad is being "
                                           "used in an in-place operation."):
        y.add_(1)


def test_inplace_on_view_backprop_base():
    """test_inplace_on_view_backprop_base: modify a view, backprop through the base."""
    root = randn(2, 2)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v1.mul_(2)
    x.sum().backward()
    assert_close(root.grad, [[2, 2], [1, 1]])


def test_inplace_on_view_backprop_view_of_view():
    """test_inplace_on_view_backprop_view_of_view: modify view, backprop through view-of-view."""
    root = randn(2, 2)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = x.narrow(0, 0, 1)
    v1.mul_(2)
    v2.sum().backward()
    assert_close(root.grad, [[2, 2], [0, 0]])


def test_inplace_on_view_of_view():
    """test_inplace_on_view_of_view: modify a view of a view, backprop through the base."""
    root = randn(2, 2)
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = v1.narrow(1, 1, 1)
    v2.mul_(2)
    x.sum().backward()
    assert_close(root.grad, [[1, 2], [1, 1]])


def test_inplace_on_view_backprop_view():
    """test_inplace_on_view_backprop_view: the view's own result backpropagates."""
    a = leaf([2.0, 5.0], requires_grad=False)
    b = leaf([3.0])
    res = a.narrow(0, 1, 1).mul_(b)
    res.sum().backward()
    assert_close(b.grad, [5.0])
    assert a.grad is None


def test_inplace_on_view_non_contig():
    """test_inplace_on_view_non_contig: a non-contiguous base."""
    data = np.ones((2, 3, 2))[:, :, 1].T  # select(2, 1).t(): shape (3, 2), not contiguous
    root = leaf(data.copy())
    root.array = data  # keep it non-contiguous, as PyTorch's test
    x = root.clone()
    v1 = x.narrow(0, 0, 1)
    v2 = v1.narrow(1, 1, 1)
    v2.mul_(2)
    x.sum().backward()
    assert_close(root.grad, [[1, 2], [1, 1], [1, 1]])


def test_inplace_on_view_gradcheck():
    """test_inplace_on_view_gradcheck: two writes into views of one base."""
    a, b = randn(4, 4, seed=1), randn(2, 2, seed=2)

    def func(root, b):
        x = root.clone()
        x.narrow(1, 2, 2).narrow(0, 1, 2).mul_(b)
        x.narrow(1, 0, 2).narrow(0, 1, 2).mul_(b)
        return x

    assert gradcheck(func, [a, b])
    assert gradgradcheck(func, (a, b), (randn(4, 4, seed=3),))


def test_inplace_on_view_makes_base_require_grad():
    """test_inplace_on_view_makes_base_require_grad."""
    a, b = randn(4, 4, requires_grad=False, seed=1), randn(4, 2, seed=2)

    def func(root, b):
        x = root.clone()
        assert not x.requires_grad
        x.narrow(1, 2, 2).mul_(b)
        assert x.requires_grad
        return x

    assert gradcheck(func, [a, b])
    assert gradgradcheck(func, (a, b), (randn(4, 4, seed=3),))


def test_inplace_on_view_modify_base():
    """test_inplace_on_view_modify_base: writing the base makes an earlier view follow it."""
    r = ones(1, requires_grad=True)

    def fn(r):
        x = ones(5)
        v = x.select(0, 1)
        assert not v.requires_grad and v.grad_fn is None
        x.add_(r)  # v now depends on r through the write into x
        assert v.requires_grad
        return v

    assert gradcheck(fn, [r])
    assert gradgradcheck(fn, [r])


def test_inplace_on_view_python():
    """test_inplace_on_view_python: a custom Function writing into views (ctx.mark_dirty)."""
    a, b = randn(4, 4, seed=1), randn(2, 2, seed=2)

    class PyAdd(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.mark_dirty(x)
            x.add_(y)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    def func(root, b):
        x = root.clone()
        PyAdd.apply(x.narrow(1, 2, 2).narrow(0, 1, 2), b)
        PyAdd.apply(x.narrow(1, 0, 2).narrow(0, 1, 2), b)
        return x

    assert gradcheck(func, [a, b])
    assert gradgradcheck(func, (a, b), (randn(4, 4, seed=3),))


def test_inplace_on_view_weak_grad_fn():
    """test_inplace_on_view_weak_grad_fn: the graph outlives the written view."""
    a = leaf(np.arange(10.0))
    b = a.narrow(0, 0, 2).clone().view(-1)
    b.relu_()
    c = b.clone()
    del b
    gc.collect()
    s = c.sum()
    s.backward()
    assert_close(s, 1.0)


def test_inplace_on_view_saved_output():
    """test_inplace_on_view_saved_output: an in-place op on a view that saves its output leaves
    no reference cycle (the graph is freed as soon as the tensors go)."""
    freed = []

    class OnDelete:
        def __call__(self, *args):
            return None

        def __del__(self):
            freed.append(1)

    def run():
        root = randn(3, 3)
        copy = root.clone()
        copy.grad_fn.register_hook(OnDelete())
        view = copy.view(9)
        hg.nn.functional.relu(view, inplace=True)

    run()
    assert freed == [1]


def test_inplace_on_view_backward():
    """test_inplace_on_view_backward: double backward through relu_ on a view."""
    x = leaf([[[[1.0, 1.0]]]])
    y = (x * 3 - 1).view(1, 1, 1, 2)
    hg.nn.ReLU(inplace=True)(y)
    (g,) = hg.autograd.grad(y ** 2, [x], grad_outputs=ones(*x.shape), create_graph=True)
    (gg,) = hg.autograd.grad(g.sum(), [x])
    assert_close(g, [[[[12.0, 12.0]]]])  # 2 * (3x - 1) * 3
    assert_close(gg, [[[[18.0, 18.0]]]])
    assert_close(x, [[[[1.0, 1.0]]]])


def test_retain_grad_inplace():
    """test_retain_grad_inplace: retain_grad follows the tensor through writes."""
    a = leaf([1.0]).clone()
    a.retain_grad()
    a.mul_(2)
    a.sum().backward()
    assert_close(a.grad, [1.0])

    a = leaf([1.0]).clone()
    a.retain_grad()
    a.mul_(2)
    a.mul_(2)
    a.sum().backward()
    assert_close(a.grad, [1.0])

    x = leaf([1.0]).clone()
    x.retain_grad()
    x_view = x[:]
    x_view *= 2
    x *= 2
    x.sum().backward()
    assert_close(x.grad, [1.0])  # the gradient of the latest version of x

    x = zeros(4)  # a base that did not require grad: no hook to move
    y = x.view(2, 2)
    y.add_(randn(2, 2))
    x.sum().backward()


def test_inplace_not_requires_grad_sanity():
    """test_inplace_not_requires_grad (its last case): a view of a base that does not require
    grad written from one that does."""
    a = randn(1, 2, requires_grad=False)
    b = randn(1, seed=1)
    a.select(1, 0).copy_(b)
    assert a.requires_grad
    a.sum().backward()
    assert_close(b.grad, [1.0])


# --- ctx.mark_dirty ------------------------------------------------------------------------------

class _MulInplace(Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_mark_dirty_rebases_and_bumps():
    root = randn(3)
    x = root.clone()
    version = x._version
    y = _MulInplace.apply(x)
    assert y is x and x._version > version
    assert x.grad_fn.name() == "_MulInplaceBackward"
    x.sum().backward()
    assert_close(root.grad, [2.0, 2.0, 2.0])


def test_mark_dirty_leaf_raises():
    """test_return_duplicate_inplace (first part): a leaf that requires grad cannot be dirty."""
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad has been used in "
                                           "an in-place operation"):
        _MulInplace.apply(randn(3))


def test_return_duplicate_inplace():
    """test_return_duplicate_inplace: the dirty input returned twice is one tensor."""
    class DoubleInplace(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x, x

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 * 2 + g2 * 2

    b, c = DoubleInplace.apply(randn(5).clone())
    assert b is c


def test_mark_dirty_not_returned_raises():
    class Forgets(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError, match="marked as dirty during the forward method were not "
                                           "returned"):
        Forgets.apply(randn(3).clone())


def test_mark_dirty_under_no_grad_bumps_version():
    x = randn(3, requires_grad=False)
    with no_grad():
        _MulInplace.apply(x)
    assert x._version == 2  # mul_ inside forward, and mark_dirty (as PyTorch)
    _MulInplace.apply(x)  # grad on, nothing requires grad: still counted
    assert x._version == 4


def test_mark_dirty_saved_input_is_checked():
    """A dirty input saved for backward is saved as the output: a later write is caught."""
    class Square(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(x)
            ctx.mark_dirty(x)
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, g):
            (out,) = ctx.saved_tensors
            return g * 2 * out.sqrt()

    root = leaf([2.0, 3.0])
    x = Square.apply(root.clone())
    x.sum().backward(retain_graph=True)
    assert_close(root.grad, [4.0, 6.0])
    with no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match=MODIFIED):
        x.grad_fn.saved_tensors  # noqa: B018  (reading it is the check)


def test_inplace_on_view_multiple_outputs():
    """test_inplace_on_view_multiple_outputs: the views of unbind/chunk/split may not be written
    in place while recording a graph (allowed under no_grad)."""
    root = leaf(np.arange(9.0).reshape(3, 3))
    x = root.clone()
    for views in (x.unbind(), x.chunk(3), x.split(1)):
        with pytest.raises(RuntimeError, match="This view is the output of a function that "
                                               "returns multiple views"):
            views[0].mul_(2)
    with no_grad():
        x.unbind()[1].mul_(2)
    assert_close(x[1].detach(), [6.0, 8.0, 10.0])


def test_inplace_on_view_of_multiple_output_view():
    """test_inplace_on_view_of_multiple_output_view: a view of such a view is refused too."""
    a = leaf(np.random.default_rng(0).random(10)).clone()
    c = a.unbind(0)[0].view(1)
    with pytest.raises(RuntimeError, match="returns multiple views"):
        c.mul_(2)
