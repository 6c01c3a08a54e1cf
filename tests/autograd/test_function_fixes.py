"""Issue 10's local-autograd defects, one test each: undefined gradients, custom Function outputs,
once_differentiable, materialize flags, numpy() under no_grad, Node.__call__, materialize_grads,
post-accumulate-grad hooks, gradient edges, saved-tensor hooks and non-reentrant checkpointing.

Expected values are PyTorch's (its behaviour, checked by hand against torch 2.13).
"""

import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, once_differentiable
from hpcgrad.autograd.graph import get_gradient_edge, saved_tensors_hooks
from hpcgrad.utils.checkpoint import CheckpointError, checkpoint


def leaf(values):
    return hg.tensor(np.asarray(values, dtype=np.float64), requires_grad=True)


class Identity(Function):
    """x -> x whose backward returns None: its input gets no gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.array.copy()

    @staticmethod
    def backward(ctx, g):
        return None


# --- undefined gradients stay undefined ---------------------------------------------------------

def test_none_from_custom_backward_stays_none_through_builtin_ops():
    w, other = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    loss = ((Identity.apply(w) * 3).exp().sum() + (other * 2).sum())
    loss.backward()
    assert w.grad is None  # zeros here made an optimizer step w
    np.testing.assert_array_equal(other.grad.array, [2.0, 2.0])


def test_optimizer_leaves_a_parameter_without_gradient_alone():
    w, other = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    opt = hg.optim.SGD([w, other], lr=0.1, momentum=0.9, weight_decay=0.5)
    (Identity.apply(w).tanh().sum() + other.sum()).backward()
    opt.step()
    np.testing.assert_array_equal(w.array, [1.0, 2.0])
    assert not np.array_equal(other.array, [3.0, 4.0])


def test_a_custom_function_still_gets_zeros_for_an_unused_output():
    seen = []

    class Two(Function):
        @staticmethod
        def forward(ctx, x):
            return x.array * 2, x.array * 3

        @staticmethod
        def backward(ctx, g1, g2):
            seen.append((g1.array.copy(), g2.array.copy()))
            return g1 * 2 + g2 * 3

    x = leaf([1.0, 2.0])
    a, _ = Two.apply(x)
    a.sum().backward()
    np.testing.assert_array_equal(seen[0][1], [0.0, 0.0])
    np.testing.assert_array_equal(x.grad.array, [2.0, 2.0])


# --- custom Function outputs ---------------------------------------------------------------------

class Mixed(Function):
    """PyTorch's test_custom_function_non_tensor_inputs_outputs, smaller."""

    @staticmethod
    def forward(ctx, t1, scale):
        ctx.scale = scale
        return scale, t1.array * scale, None, True, "bar"

    @staticmethod
    def backward(ctx, *grads):
        assert len(grads) == 5
        assert grads[0] is None and grads[2] is None and grads[3] is None and grads[4] is None
        return grads[1] * ctx.scale, None


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_non_tensor_outputs_come_back_unchanged(grad_enabled):
    t1 = leaf([1.0, 2.0])
    with hg.set_grad_enabled(grad_enabled):
        scale, out, none, flag, text = Mixed.apply(t1, 3)
    assert (scale, none, flag, text) == (3, None, True, "bar")
    assert type(scale) is int and type(flag) is bool
    np.testing.assert_array_equal(out.array, [3.0, 6.0])
    if grad_enabled:
        out.sum().backward()
        np.testing.assert_array_equal(t1.grad.array, [3.0, 3.0])


def test_a_none_output_does_not_break_backward():
    class WithNone(Function):
        @staticmethod
        def forward(ctx, x):
            return x.array * 2, None

        @staticmethod
        def backward(ctx, g, g_none):
            assert g_none is None
            return g * 2

    x = leaf([1.0, 2.0])
    y, nothing = WithNone.apply(x)
    assert nothing is None
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.array, [2.0, 2.0])


def test_return_duplicate():
    class DoubleDuplicate(Function):
        @staticmethod
        def forward(ctx, x):
            output = x.array * 2
            return output, output

        @staticmethod
        def backward(ctx, grad1, grad2):
            return grad1 * 2 + grad2 * 2

    def fn(x):
        a, b = DoubleDuplicate.apply(x)
        assert a is b
        return a + b

    x = hg.tensor(np.random.default_rng(0).standard_normal((5, 5)), requires_grad=True)
    assert hg.autograd.gradcheck(fn, [x])
    assert hg.autograd.gradgradcheck(fn, [x])


# --- once_differentiable and the materialize flags ---------------------------------------------

class Square(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.array ** 2

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        assert not hg.is_grad_enabled()
        return g * 2 * x


def test_once_differentiable_first_order():
    x = leaf([1.0, -2.0])
    Square.apply(x).sum().backward()
    np.testing.assert_array_equal(x.grad.array, [2.0, -4.0])


def test_once_differentiable_refuses_a_second_derivative():
    x, v = leaf([1.0, -2.0]), leaf([1.0, 1.0])  # v requires grad: the backward's input does
    (g,) = hg.autograd.grad(Square.apply(x), x, v, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="trying to differentiate twice a function that was "
                                           "marked with @once_differentiable"):
        g.sum().backward()


def test_mark_non_differentiable_and_materialize_non_diff_grads():
    seen = []

    class Func(Function):
        @staticmethod
        def forward(ctx, x, materialize):
            out0, out1 = x.array.copy(), x.array.copy()
            ctx.mark_non_differentiable(out1)
            ctx._materialize_non_diff_grads = materialize
            return out0, out1

        @staticmethod
        def backward(ctx, g0, g1):
            seen.append(g1)
            return g0, None

    for materialize in (True, False):
        x = leaf([1.0, 2.0])
        out0, out1 = Func.apply(x, materialize)
        assert out0.requires_grad and not out1.requires_grad
        out0.sum().backward()
        np.testing.assert_array_equal(x.grad.array, [1.0, 1.0])
    assert seen[1] is None
    np.testing.assert_array_equal(seen[0].array, [0.0, 0.0])


def test_set_materialize_grads_false_passes_none():
    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x.array.copy(), x.array.copy()

        @staticmethod
        def backward(ctx, g1, g2):
            assert g2 is None
            return g1

    x = leaf([1.0, 2.0])
    Func.apply(x)[0].sum().backward()
    np.testing.assert_array_equal(x.grad.array, [1.0, 1.0])


# --- small API gaps ------------------------------------------------------------------------------

def test_numpy_is_allowed_under_no_grad():
    x = leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match="Can't call numpy"):
        x.numpy()
    with hg.no_grad():
        np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])


def test_node_call_applies_the_backward_formula():
    a = leaf([1.0, 2.0])
    b = leaf([3.0, 4.0])
    grad_a, grad_b = (a * b).grad_fn(hg.ones(2, dtype=np.float64))
    np.testing.assert_array_equal(grad_a.array, [3.0, 4.0])
    np.testing.assert_array_equal(grad_b.array, [1.0, 2.0])
    assert a.grad is None  # nothing accumulates


def test_grad_materialize_grads():
    x, unused = leaf([1.0, 2.0]), leaf([5.0])
    gx, gu = hg.autograd.grad((x * x).sum(), [x, unused], materialize_grads=True)
    np.testing.assert_array_equal(gx.array, [2.0, 4.0])
    np.testing.assert_array_equal(gu.array, [0.0])
    with pytest.raises(ValueError, match="Expected allow_unused to be True or not passed"):
        hg.autograd.grad((x * x).sum(), [x, unused], allow_unused=False, materialize_grads=True)


def test_post_accumulate_grad_hook_sees_the_accumulated_grad():
    x = leaf([1.0, 2.0])
    seen = []
    handle = x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.array.copy()))
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_array_equal(np.stack(seen), [[2.0, 2.0], [5.0, 5.0]])
    handle.remove()
    (x * 2).sum().backward()
    assert len(seen) == 2
    with pytest.raises(RuntimeError, match="non-leaf"):
        (x * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        hg.ones(2).register_post_accumulate_grad_hook(lambda t: None)
    x.register_post_accumulate_grad_hook(lambda t: t)
    with pytest.raises(RuntimeError, match="should return None"):
        (x * 2).sum().backward()


def test_gradient_edge_output():
    """PyTorch's test_gradient_edge_output, with exp/tanh in place of sin/cos."""
    x = leaf([1.0, 2.0])

    def fn(x, reduce=True):
        tmp = x.tanh().exp()
        if reduce:
            tmp = tmp.sum()
        out = (tmp.exp().clone().tanh()).sum()
        return out, get_gradient_edge(tmp)

    for reduce in (True, False):
        out, tmp_edge = fn(x, reduce)
        (tmp_grad,) = hg.autograd.grad(out, (tmp_edge,))
        (x_grad,) = hg.autograd.grad(tmp_edge, (x,), (tmp_grad,))
        out, _ = fn(x, reduce)
        (expected,) = hg.autograd.grad(out, (x,))
        np.testing.assert_allclose(x_grad.array, expected.array, rtol=1e-12)
    with pytest.raises(RuntimeError, match="does not require gradients"):
        get_gradient_edge(hg.ones(2))


# --- saved-tensor hooks --------------------------------------------------------------------------

def test_saved_tensors_hooks_pack_and_unpack_every_saved_tensor():
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return t.array.copy()  # a copy outside the graph: the original may go

    def unpack(array):
        unpacked.append(array)
        return hg.tensor(array)

    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    with saved_tensors_hooks(pack, unpack):
        y = a * b
    assert len(packed) == 2
    y.sum().backward()
    assert len(unpacked) == 2
    np.testing.assert_array_equal(a.grad.array, [3.0, 4.0])
    np.testing.assert_array_equal(b.grad.array, [1.0, 2.0])


def test_saved_tensors_hooks_unpack_decides_the_value():
    a = leaf([1.0, 2.0])
    with saved_tensors_hooks(lambda t: None, lambda _: hg.tensor(np.array([10.0, 10.0]))):
        y = a * a
    y.sum().backward()
    np.testing.assert_array_equal(a.grad.array, [20.0, 20.0])


def test_saved_tensors_hooks_released_after_backward():
    a = leaf([1.0, 2.0])
    with saved_tensors_hooks(lambda t: t, lambda t: t):
        y = (a * a).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_saved_tensors_hooks_bad_arguments():
    with pytest.raises(TypeError, match="two callables"):
        saved_tensors_hooks(1, lambda t: t)
    a = leaf([1.0])
    with saved_tensors_hooks(lambda t: t, lambda t: "not a tensor"):
        y = (a * a).sum()
    with pytest.raises(TypeError, match="unpack hook must return a Tensor"):
        y.backward()


# --- non-reentrant checkpointing -----------------------------------------------------------------

def _block_params():
    rng = np.random.default_rng(1)
    return (hg.tensor(rng.standard_normal((4, 5)), requires_grad=True),
            hg.tensor(rng.standard_normal((5, 3)), requires_grad=True))


def test_checkpoint_without_reentrant_matches_and_works_with_grad():
    w1, w2 = _block_params()
    x = hg.tensor(np.random.default_rng(2).standard_normal((2, 4)), requires_grad=True)

    def block(x, scale=1.0):
        return ((x @ w1).tanh() @ w2).sigmoid() * scale

    expected = hg.autograd.grad(block(x, scale=2.0).sum(), [x, w1, w2])
    out = checkpoint(block, x, use_reentrant=False, scale=2.0)
    got = hg.autograd.grad(out.sum(), [x, w1, w2], retain_graph=True)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.array, e.array, rtol=1e-12)
    again = hg.autograd.grad(out.sum(), [w2])  # a second backward recomputes
    np.testing.assert_allclose(again[0].array, expected[2].array, rtol=1e-12)
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        hg.autograd.grad(checkpoint(block, x).sum(), [x])  # the reentrant one refuses


def test_checkpoint_without_reentrant_keeps_no_activation():
    w1, w2 = _block_params()
    x = hg.tensor(np.ones((2, 4)), requires_grad=True)
    refs = []

    def block(x):
        h = (x @ w1).tanh()
        refs.append(weakref.ref(h.array))
        return h @ w2

    out = checkpoint(block, x, use_reentrant=False)
    gc.collect()
    assert refs[0]() is None  # tanh's output (saved by tanh and matmul) was not kept
    out.sum().backward()
    assert w1.grad is not None and w2.grad is not None


def test_checkpoint_without_reentrant_detects_a_different_recompute():
    w1, _ = _block_params()
    calls = []

    def block(x):
        calls.append(1)
        y = x @ w1
        return y * y if len(calls) == 1 else y  # saves 3 tensors, then 1

    out = checkpoint(block, hg.tensor(np.ones((2, 4))), use_reentrant=False)
    with pytest.raises(CheckpointError, match="different number of tensors"):
        out.sum().backward()


def test_reentrant_checkpoint_refuses_keyword_arguments():
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        checkpoint(lambda x, scale: x * scale, leaf([1.0]), scale=2.0)
