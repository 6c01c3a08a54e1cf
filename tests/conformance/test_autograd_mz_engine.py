"""Ports of PyTorch's TestAutograd engine tests (test_m*..test_z*): reentrant backward, callbacks, anomaly.

Left out (hpcgrad does not build them): CUDA device threads (test_simple_reentrant_cross_device,
test_reentrant_parent_error_on_cpu), torch._C._current_graph_task_* introspection, thread
shutdown messages (test_thread_shutdown), in-place ops (test_pynode_destruction_deadlock).
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, grad
from hpcgrad.autograd.engine import get_default_engine

import autograd_mz_helpers as m

close = m.h.assert_close


class SimulateBackwardError(Function):
    """PyTorch's TestAutograd.SimulateBackwardError."""

    @staticmethod
    def forward(ctx, input):
        return input.clone()

    @staticmethod
    @m.once_differentiable
    def backward(ctx, input):
        raise Exception("Simulate error on backward pass")


def test_simple_reentrant():
    y_data = m.randn(2, 2, seed=1)

    class Reenter(Function):
        @staticmethod
        def forward(ctx, x):
            with hg.enable_grad():
                ctx.x = x.detach().requires_grad_()
                ctx.y = y_data.detach().requires_grad_()
                ctx.output_var = ctx.x * ctx.y
            return ctx.output_var.detach()

        @staticmethod
        def backward(ctx, grad_output):
            with hg.enable_grad():
                ctx.output_var.sum().backward()
            return ctx.x.grad * grad_output

    x = m.randn(2, 2, requires_grad=True)
    Reenter.apply(x).sum().backward()
    close(x.grad, y_data)


def test_reentrant_child_error():
    a = m.rand(3, 3, requires_grad=True)
    c = a * a  # parent graph
    b = m.rand(3, 3, requires_grad=True, seed=1)
    e = b * b  # reentrant child graph, whose backward fails
    reentrant_root = SimulateBackwardError.apply(e).sum()

    class ReentrantFunc(Function):
        @staticmethod
        def forward(ctx, inp):
            return inp.clone()

        @staticmethod
        def backward(ctx, grad):
            reentrant_root.backward()
            return grad

    d = ReentrantFunc.apply(c)
    with pytest.raises(Exception, match="Simulate error"):
        d.sum().backward()


def test_reentrant_priority():
    order = []

    class MyFunction(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, x):
            order.append("MyFunction")
            return x

    class Reentrant(Function):
        @staticmethod
        def forward(ctx, x):
            with hg.enable_grad():
                ctx.x = x.detach().requires_grad_()
                ctx.x = ctx.x - 1
            return ctx.x.detach()

        @staticmethod
        def backward(ctx, x):
            order.append("Reentrant")
            if ctx.x < 0:
                return x
            with hg.enable_grad():
                Reentrant.apply(ctx.x).backward()
            return x

    a = MyFunction.apply(m.t(6.0, requires_grad=True))
    b = Reentrant.apply(m.t(9.0, requires_grad=True))
    (a * b).backward()
    # Both backward Nodes are ready at once; Reentrant runs first and every Node of its nested
    # backwards goes before MyFunction, whatever the sequence numbers.
    assert len(order) == 11
    assert order.count("Reentrant") == 10
    assert order[-1] == "MyFunction"


def _reentrant_with_callbacks(install_callbacks_in_depths):
    counter = {"inner": 0, "outer": 0}

    def inc_inner_counter():
        counter["inner"] += 1

    def inc_outer_counter():
        counter["outer"] += 1

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, input):
            return input

        @staticmethod
        @m.once_differentiable
        def backward(ctx, input):
            if 1 in install_callbacks_in_depths:
                get_default_engine().queue_callback(inc_inner_counter)
            return input

    class MyReentrantFunc(Function):
        @staticmethod
        def forward(ctx, input):
            return input

        @staticmethod
        @m.once_differentiable
        def backward(ctx, input):
            if 0 in install_callbacks_in_depths:
                get_default_engine().queue_callback(inc_outer_counter)
            tmp_inp = input.detach().requires_grad_()
            with hg.enable_grad():
                tmp_out = MyFunc.apply(tmp_inp).sum()
            tmp_out.backward()  # reentrant
            return input

    t1 = m.rand(3, 3, requires_grad=True)
    hg.autograd.backward([MyReentrantFunc.apply(t1).sum()])
    return counter


@pytest.mark.parametrize("depths,outer,inner", [
    pytest.param([0], 1, 0, id="test_reentrant_with_callbacks_depth_0"),
    pytest.param([1], 0, 1, id="test_reentrant_with_callbacks_depth_1"),
    pytest.param([0, 1], 1, 1, id="test_reentrant_with_callbacks_both_depths"),
])
def test_reentrant_with_callbacks(depths, outer, inner):
    # A callback belongs to the backward (graph task) that queued it and runs exactly once.
    counter = _reentrant_with_callbacks(depths)
    assert counter["outer"] == outer
    assert counter["inner"] == inner


def test_reentrant_with_leaf_variable_hook():
    handle = None
    param = m.rand(10, requires_grad=True)

    def add_gradient_penalty_to_grad(grad):
        handle.remove()
        old_param_grad = grad
        param.grad = None
        with hg.enable_grad():  # a gradient penalty computed by a backward inside the hook
            g = grad.detach().requires_grad_()
            new_param = param.detach().requires_grad_()
            out = ((g * 2) + new_param).sum()
            out.backward()
        res = g.grad + grad
        param.grad = old_param_grad
        return res

    handle = param.register_hook(add_gradient_penalty_to_grad)
    (param * param).sum().backward()
    # PyTorch (torch 2.13, computed locally): the hook's result 2 + 2p accumulates into the
    # .grad it restored (2p): 4p + 2.
    close(param.grad, 4 * m.h.arr(param) + 2)


def test_reentrant_with_leaf_variable_hook_matches_torch():
    """The same hook in PyTorch gives the same .grad (the value asserted above)."""
    torch = m.h.torch_or_skip()
    data = m.h.arr(m.rand(10))

    def run(lib, param, enable_grad):
        handle = None

        def hook(grad):
            handle.remove()
            old_param_grad = grad
            param.grad = None
            with enable_grad():
                g = grad.detach().requires_grad_()
                ((g * 2) + param.detach().requires_grad_()).sum().backward()
            res = g.grad + grad
            param.grad = old_param_grad
            return res

        handle = param.register_hook(hook)
        (param * param).sum().backward()
        return np.asarray(param.grad.detach().numpy() if lib == "torch" else m.h.arr(param.grad))

    ours = run("hpcgrad", m.t(data, requires_grad=True), hg.enable_grad)
    theirs = run("torch", torch.tensor(data, requires_grad=True), torch.enable_grad)
    close(ours, theirs)


def test_reentrant_with_non_leaf_variable_hook():
    handle = None
    param = m.rand(10, requires_grad=True)

    def manual_increase_gradient(grad):
        handle.remove()
        with hg.enable_grad():
            g = grad.detach().requires_grad_()
            out = ((g * 2) + 5).sum()
            out.backward()
        return g.grad + grad

    tmp = param * param
    handle = tmp.register_hook(manual_increase_gradient)
    tmp.sum().backward()
    close(param.grad, 6 * m.h.arr(param))


def test_nested_anomaly_detect_nan(capsys):
    size = 10

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, inp1, fail_0th):
            ctx.fail_0th = fail_0th
            ctx.save_for_backward(inp1)
            return inp1.sum(0, keepdim=True)

        @staticmethod
        def backward(ctx, gO):
            (inp,) = ctx.saved_tensors
            g = gO.expand(size)
            return MyFunc2.apply(g * inp, g + inp, ctx.fail_0th), None

    class MyFunc2(Function):
        @staticmethod
        def forward(ctx, inp1, inp2, fail_0th):
            ctx.fail_0th = fail_0th
            return inp1 * 2.0 + inp2

        @staticmethod
        def backward(ctx, gO):
            # PyTorch: g[0] = 0; g[0] /= 0 on one of two clones. Same values without setitem.
            nan_first = m.t([np.nan] + [1.0] * (size - 1))
            g1, g2 = (gO * nan_first, gO) if ctx.fail_0th else (gO, gO * nan_first)
            return g1, g2, None

    inp = m.rand(size, requires_grad=True)
    out = MyFunc.apply(inp, True)
    (ginp,) = grad(out, (inp,), create_graph=True)
    ginp.sum().backward()  # no anomaly mode: the nan passes silently

    inp = m.rand(size, requires_grad=True)
    out = MyFunc.apply(inp, True)
    (ginp,) = grad(out, (inp,), create_graph=True)
    gsum = ginp.sum()
    with pytest.raises(RuntimeError,
                       match="Function 'MyFunc2Backward' returned nan values in its 0th output."):
        with hg.autograd.detect_anomaly():
            gsum.backward()

    inp = m.rand(size, requires_grad=True)
    with pytest.raises(RuntimeError,
                       match="Function 'MyFunc2Backward' returned nan values in its 1th output."):
        with pytest.warns(UserWarning) as warned, hg.autograd.detect_anomaly():
            out = MyFunc.apply(inp, False)
            (ginp,) = grad(out, (inp,), create_graph=True)
            ginp.sum().backward()
    # The Node was created under anomaly mode: PyTorch warns with its forward stack.
    assert any("Traceback of forward call" in str(w.message) and "MyFunc2.apply" in str(w.message)
               for w in warned)


def test_node_ordering_when_none_returned():
    # CUDA/bfloat16 in PyTorch; the ordering is the engine's, so it is checked on CPU (torch 2.13
    # CPU gives the same ["B", "A"], the hook called with None). Matmul returns None for w: w's
    # AccumulateGrad still becomes ready at once, and runs (with its hook) before HookFunction.
    class Matmul(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g_out):
            x, w = ctx.saved_tensors
            # PyTorch also stores w.main_grad = x.T @ g_out (a Megatron pattern); hpcgrad
            # Tensors have __slots__ and take no ad-hoc attributes, and it is not the point here.
            return g_out @ w.T, None

    executed = []

    class HookFunction(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            executed.append("A")
            return g

    def hook(*args, **kwargs):
        executed.append("B")

    x = HookFunction.apply(m.randn(3, 3, requires_grad=True))
    w = m.randn(3, 3, requires_grad=True, seed=1)
    w.register_hook(hook)
    Matmul.apply(x, w).sum().backward()
    assert executed == ["B", "A"]
    assert w.grad is None
