"""Ports of PyTorch's TestAutograd custom-Function tests (test_m*..test_z*): ctx, outputs, gradients.

Left out (hpcgrad does not build them): in-place custom Functions and mark_dirty
(test_return_duplicate_inplace, test_return_leaf_inplace), setup_context/vmap staticmethods
(test_setup_context_when_forward_has_default_args), legacy non-static Functions and their
deprecation messages (test_naughty_autograd_function_attribute_access,
test_saved_variables_deprecated), the private ctx._materialize_non_diff_grads
(test_set_materialize_non_diff_grads), test_naughty_anomaly_access (an expected failure in
PyTorch itself).
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, gradcheck, gradgradcheck
from hpcgrad.sparse import SparseCOOTensor

import autograd_mz_helpers as m

close = m.h.assert_close


def data_ptr(array):
    """Address of an array's first element: PyTorch's tests keep data_ptr(), never a reference
    (a reference would itself stop the engine from adopting the buffer)."""
    return array.__array_interface__["data"][0]


def test_mark_non_differentiable():
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, input):
            output = input > 0
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return (grad_output * 0).to(np.float64)

    x = m.randn(5, 5, requires_grad=True)
    mask = MyFunction.apply(x)
    assert not mask.requires_grad
    y = hg.where(mask, 0.0, x)  # x.masked_fill(mask, 0)
    y.sum().backward()
    close(x.grad, np.where(m.h.arr(mask), 0.0, 1.0))


def test_mark_non_differentiable_mixed():
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, input):
            a = input + 1
            b = input + 2
            ctx.mark_non_differentiable(a)
            return a, b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            assert (m.h.arr(grad_a) == 0).all()
            assert (m.h.arr(grad_b) == 1).all()
            return grad_b

    x = m.randn(5, 5, requires_grad=True)
    a, b = MyFunction.apply(x)
    assert not a.requires_grad
    assert b.requires_grad
    b.sum().backward()
    close(x.grad, np.ones((5, 5)))


def test_mark_non_differentiable_none():
    # The None that MyFunction's backward returns must reach MulBackward as "no gradient"
    # (this used to segfault in PyTorch, whose built-in Nodes expect defined gradients).
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, input):
            output = input.clone()
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return None

    x = m.randn(5, 5, requires_grad=True)
    r = MyFunction.apply(x * x)
    (r * x).sum().backward()
    close(x.grad, m.h.arr(x) ** 2)  # only the r * x path: r does not lead back to x


class _DoubleDuplicate(Function):
    @staticmethod
    def forward(ctx, x):
        output = x * 2
        return output, output

    @staticmethod
    def backward(ctx, grad1, grad2):
        return grad1 * 2 + grad2 * 2


def test_return_duplicate():
    def fn(x):
        a, b = _DoubleDuplicate.apply(x)
        assert a is b
        return a + b

    x = m.randn(5, 5, requires_grad=True)
    assert gradcheck(fn, [x])
    assert gradgradcheck(fn, [x])


def test_return_leaf():
    class Identity(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a, a + b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_a + grad_b, grad_b

    hook_called = [False]
    x = m.randn(5, 5, requires_grad=True)
    y = m.randn(5, 5, requires_grad=True, seed=1)
    q, p = Identity.apply(x, y)

    def hook(grad):  # sees only the gradient from the uses of q, not those of x
        hook_called[0] = True
        close(grad, np.ones((5, 5)))

    q.register_hook(hook)
    (q + p + x).sum().backward()
    close(x.grad, np.ones((5, 5)) * 3)
    close(y.grad, np.ones((5, 5)))
    assert hook_called[0]


def test_save_none_for_backward():
    class MyFn(Function):
        @staticmethod
        def forward(ctx, input):
            ctx.save_for_backward(None, input, None)
            return input * input

        @staticmethod
        def backward(ctx, grad_output):
            n1, input, n2 = ctx.saved_tensors
            assert n1 is None and n2 is None
            return 2 * input * grad_output

    x = m.randn(5, 5, requires_grad=True)
    MyFn.apply(x).sum().backward()
    close(x.grad, 2 * m.h.arr(x))


def test_too_many_grads():
    # Extra None gradients past the number of inputs are allowed.
    class MyFn(Function):
        @staticmethod
        def forward(ctx, input):
            return input

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None, None

    x = m.randn(5, 5, requires_grad=True)
    MyFn.apply(x).sum().backward()
    close(x.grad, np.ones((5, 5)))


def test_save_output_nr():
    x = m.randn(10, requires_grad=True)

    class MultiOutputFn(Function):
        @staticmethod
        def forward(ctx, x):
            return x[:5], x[5:]

        @staticmethod
        def backward(ctx, *grad):
            return hg.cat(list(grad))

    a, b = MultiOutputFn.apply(x)
    assert b.output_nr == 1

    seen = []

    class TestFn(Function):
        @staticmethod
        def forward(ctx, b):
            ctx.save_for_backward(b)
            return b * 2

        @staticmethod
        def backward(ctx, grad_b):
            (b,) = ctx.saved_tensors
            seen.append(b.output_nr)  # a saved input keeps its output_nr

    TestFn.apply(b).sum().backward()
    assert seen == [1]


def test_not_implemented_grad():
    # PyTorch: torch.nextafter has no derivative. Here: a Function that defines no backward.
    class NoBackward(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

    a = m.rand(2, requires_grad=True)
    y = NoBackward.apply(a).sum()
    with pytest.raises(NotImplementedError, match="backward"):
        y.backward()


@pytest.mark.skip(reason="not built (README): hpcgrad's ctx is the graph Node itself, so a ctx "
                  "stashed past its graph keeps the saved tensors; PyTorch's ctx holds the Node weakly")
def test_naughty_autograd_function_stashing_ctx():
    saved_ctx = []

    class Id(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, grad_x):
            saved_ctx.append(ctx)
            return ctx.saved_tensors

    p = m.zeros(1, requires_grad=True)
    loss = Id.apply(p)
    loss.backward(retain_graph=True)
    del loss
    # The graph is gone: its saved tensors must be too.
    with pytest.raises(RuntimeError):
        saved_ctx[0].saved_tensors


def _function_test(cls):
    """PyTorch's TestAutograd._function_test: cls.apply(x, 2, y), backward with create_graph."""
    x = m.randn(5, 5, requires_grad=True)
    y = m.randn(5, 5, requires_grad=True, seed=1)
    result = cls.apply(x, 2, y)
    go = m.t(1.0, requires_grad=True)
    result.sum().backward(go, create_graph=True)
    close(x.grad, m.h.arr(y) + 1)
    close(y.grad, m.h.arr(x) + 2)
    assert x.grad.grad_fn is not None
    assert y.grad.grad_fn is not None
    return x, y


def test_once_differentiable():
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, tensor1, pyscalar, tensor2):
            ctx.pyscalar = pyscalar
            ctx.save_for_backward(tensor1, tensor2)
            return tensor1 + pyscalar * tensor2 + tensor1 * tensor2

        @staticmethod
        @m.once_differentiable
        def backward(ctx, grad_output):
            assert not hg.is_grad_enabled()
            t1, t2 = ctx.saved_tensors
            return (grad_output + grad_output * t2, None,
                    grad_output * ctx.pyscalar + grad_output * t1)

    x, y = _function_test(MyFunction)
    # PyTorch's graph: CopyBackwards(None, Error(AccumulateGrad(), None, AccumulateGrad())):
    # the gradient has a grad_fn, and differentiating through it is an error.
    with pytest.raises(RuntimeError, match="once_differentiable"):
        x.grad.sum().backward()


def test_no_grad_copy():
    # A gradient that nothing else holds is adopted as .grad without a copy; one that is
    # non-contiguous, or handed to two leaves, is copied (at least for one of them).
    static = {}

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp1, inp2):
            return inp1 + inp2

        @staticmethod
        def backward(ctx, grad):
            static["grad"] = data_ptr(grad.array)
            return grad, grad

    class NonContGradFunc(Function):
        @staticmethod
        def forward(ctx, inp1):
            ctx.size = inp1.shape
            return np.array([1.0])

        @staticmethod
        def backward(ctx, grad):
            return m.ones(1).expand(*ctx.size)

    a = m.randn(5, 6, requires_grad=True)
    b = m.randn(5, 6, requires_grad=True, seed=1)
    NonContGradFunc.apply(MyFunc.apply(a, b)).backward()
    assert data_ptr(a.grad.array) != static["grad"]
    assert data_ptr(b.grad.array) != static["grad"]
    close(a.grad, np.ones((5, 6)))

    a.grad = b.grad = None
    MyFunc.apply(a, b)[1][0].backward()
    p_a, p_b, p_g = data_ptr(a.grad.array), data_ptr(b.grad.array), static["grad"]
    assert p_a != p_b  # a and b get different buffers
    assert p_a == p_g or p_b == p_g  # one of them takes the computed one
    expected = np.zeros((5, 6))
    expected[1, 0] = 1
    close(a.grad, expected)
    close(b.grad, expected)


def test_no_grad_copy_sparse():
    # PyTorch uses F.embedding_bag(sparse=True); hpcgrad's row-sparse op is embedding(sparse=True),
    # which gives the same gradient rows for a sum of the looked-up rows.
    static = {}

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp1, inp2):
            return inp1 + inp2

        @staticmethod
        def backward(ctx, grad):
            static["values"] = data_ptr(grad.values)
            return grad, grad

    class NonContGradFunc(Function):
        @staticmethod
        def forward(ctx, inp1, inp2):
            return inp1 + inp2

        @staticmethod
        def backward(ctx, grad):
            # Row-sparse gradient with non-contiguous (broadcast) indices and values.
            v = np.random.default_rng(3).random((1, 3))
            ngrad = SparseCOOTensor(np.broadcast_to(np.ones(1, np.int64), (8,)),
                                    np.broadcast_to(v, (8, 3)), (10, 3))
            static["values"] = data_ptr(ngrad.values)
            return ngrad, ngrad

    a = m.randn(10, 3, requires_grad=True)
    b = m.randn(10, 3, requires_grad=True, seed=1)
    indices = np.array([1, 2, 4, 5, 4, 3, 2, 9])
    counts = np.bincount(indices, minlength=10)[:, None] * np.ones((1, 3))

    loss = hg.nn.functional.embedding(indices, MyFunc.apply(a, b), sparse=True).sum()
    loss.backward(retain_graph=True)
    p_a, p_b, p_g = data_ptr(a.grad.values), data_ptr(b.grad.values), static["values"]
    assert p_a != p_b
    assert p_a == p_g or p_b == p_g
    for _ in range(10):  # accumulation into the adopted buffer must not disturb the other
        loss.backward(retain_graph=True)
    close(a.grad.to_dense(), 11 * counts)
    close(b.grad.to_dense(), 11 * counts)

    a.grad = b.grad = None
    loss = hg.nn.functional.embedding(indices, NonContGradFunc.apply(a, b), sparse=True).sum()
    loss.backward(retain_graph=True)
    p_a, p_b, p_g = data_ptr(a.grad.values), data_ptr(b.grad.values), static["values"]
    assert p_a != p_b
    assert p_a != p_g and p_b != p_g  # both copied
    for _ in range(10):
        loss.backward(retain_graph=True)
    close(a.grad.to_dense(), b.grad.to_dense())
