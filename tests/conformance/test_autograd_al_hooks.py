"""Ports of PyTorch's TestAutograd hook and gradient-edge tests (test_a*..test_l*).

Tensor hooks, Node pre/post hooks, AccumulateGrad hooks, final callbacks, and
``autograd.graph.get_gradient_edge`` / ``GradientEdge`` as inputs and outputs of grad/backward.
Left out (hpcgrad does not build them): Module full backward hooks
(test_full_backward_hook_double_backward, test_create_graph_and_full_backward_hook_cycle, the
module hook of test_backward_hook_relative_ordering), register_multi_grad_hook, complex
grad_outputs (the dtype case of test_gradient_edge_output), Tensor.set_ and in-place ops
(test_grad_to_node_set, test_grad_to_node_inplace), CUDA-only callbacks
(test_callback_propagates_errors_from_device_thread).
"""

import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, grad
from hpcgrad.autograd.graph import GradientEdge, get_gradient_edge

import autograd_al_helpers as a

close = a.close
arr = a.arr


class _VarMean(Function):
    """torch.var_mean(x, dim=0) as one two-output Node (hpcgrad has var and mean, not var_mean)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        data = x.array
        return data.var(0, ddof=1), data.mean(0)

    @staticmethod
    def backward(ctx, gvar, gmean):
        x, = ctx.saved_tensors
        n = x.shape[0]
        centered = x - x.mean(0, keepdim=True)
        return gvar * centered * (2.0 / (n - 1)) + gmean / n


# --- tensor hooks -------------------------------------------------------------------------------

def test_hooks():
    x = a.ones(5, 5, requires_grad=True)
    y = (a.ones(5, 5) * 4).requires_grad_(True)
    counter = [0]

    def bw_hook(inc, grad):
        assert isinstance(grad, hg.Tensor)
        counter[0] += inc

    z = x ** 2 + x * 2 + x * y + y
    x.register_hook(lambda *args: bw_hook(0, *args))
    test = z.register_hook(lambda *args: bw_hook(1, *args))
    z.backward(a.ones(5, 5), retain_graph=True)
    assert counter[0] == 1

    test2 = z.register_hook(lambda *args: bw_hook(2, *args))
    z.backward(a.ones(5, 5), retain_graph=True)
    assert counter[0] == 4

    test2.remove()
    z.backward(a.ones(5, 5), retain_graph=True)
    assert counter[0] == 5

    def bw_hook_modify(grad):
        return grad * 2

    test.remove()
    z.register_hook(bw_hook_modify)
    with hg.no_grad():
        y.grad.zero_()
    z.backward(a.ones(5, 5), retain_graph=True)
    close(y.grad, (arr(x) + 1) * 2)

    y.register_hook(bw_hook_modify)
    with hg.no_grad():
        y.grad.zero_()
    z.backward(a.ones(5, 5))
    close(y.grad, (arr(x) + 1) * 4)


def test_hook_with_no_name():
    class MyHookClass:  # a callable without __name__
        def __call__(self, grad):
            return grad.clone()

    x = a.randn(5, requires_grad=True).clone()
    x.register_hook(MyHookClass())
    x.sum().backward()


def test_hook_none():
    class NoneGradientFunction(Function):
        @staticmethod
        def forward(ctx, x, y):
            assert ctx.needs_input_grad[0]
            assert not ctx.needs_input_grad[1]
            return x, y

        @staticmethod
        def backward(ctx, grad_x, grad_y):
            return grad_x, None

    was_called = [False]

    def hook(grad):
        assert grad is not None
        was_called[0] = True

    x = a.randn(5, 5, requires_grad=True)
    y = a.randn(5, 5, seed=1)
    rx, ry = NoneGradientFunction.apply(x, y)
    rx.register_hook(hook)
    ry.register_hook(hook)
    sum([rx, ry]).sum().backward()
    assert was_called[0]


def test_hooks_cpp():
    # hooks on the output of a built-in layer (PyTorch: a C++ BatchNorm Node)
    bn = hg.nn.BatchNorm1d(5, affine=False).double()
    bn.eval()
    counter = [0]

    def bw_hook(grad):
        counter[0] += 1
        return grad * 2

    x = a.ones(5, 5, requires_grad=True)
    z = bn(x)
    z.register_hook(bw_hook)
    z.sum().backward()
    assert counter[0] == 1, "bw_hook not called"
    close(x.grad, np.ones((5, 5)) * 2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("use_custom_function", [True, False])
@pytest.mark.parametrize("use_tensor_hook", [True, False])
def test_hook_closure_cycle(use_custom_function, use_tensor_hook):
    # hook -> closure -> grad_fn_b -> hook: the cycle must stay alive while the graph is used,
    # and be collected once it is not (PyTorch issue 102174).
    class Identity(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Sentinel:
        pass

    count = [0]

    def scope():
        x = a.t(1.0, requires_grad=True)
        b = Identity.apply(x) if use_custom_function else x.clone()
        grad_fn_b = b.grad_fn
        obj = Sentinel()

        def hook(*args):
            grad_fn_b  # noqa: B018 (the closure holds grad_fn_b and obj)
            obj  # noqa: B018
            count[0] += 1

        if use_tensor_hook:
            b.register_hook(hook)
        else:
            b.grad_fn.register_hook(hook)
        return b.clone(), weakref.ref(obj)

    gc.disable()
    try:
        out, ref = scope()
        out.backward(retain_graph=True)
        gc.collect()
        out.backward(retain_graph=True)  # the hook survived the collection and still runs
        assert count[0] == 2
        assert ref() is not None
        del out
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()


# --- Node hooks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("use_custom_function", [True, False])
def test_grad_fn_prehooks(use_custom_function):
    mul2 = a.mul2(use_custom_function)
    x = a.t([1.0], requires_grad=True)
    b = mul2(x)
    post_counter = [0]
    pre_counter = [0]

    def posthook(grad_input, grad_output):
        assert pre_counter[0] == 3
        close(grad_output[0], np.ones(1) * 8)
        close(grad_input[0], np.ones(1) * 16)
        post_counter[0] += 1
        return grad_input

    def prehook(grad_output):
        pre_counter[0] += 1
        return (grad_output[0] * 2,)

    b.grad_fn.register_hook(posthook)
    b.grad_fn.register_hook(posthook)
    b.grad_fn.register_prehook(prehook)
    b.grad_fn.register_prehook(lambda g: None)
    b.grad_fn.register_prehook(prehook)
    b.grad_fn.register_prehook(prehook)
    b.grad_fn.register_prehook(lambda g: g)
    b.grad_fn.register_prehook(lambda g: None)
    b.sum().backward()
    assert post_counter[0] == 2
    assert pre_counter[0] == 3

    # a pre-hook returning None leaves the gradient as it is
    x = a.rand(3, 3, requires_grad=True)
    b = mul2(x)

    def prehook_none(grad_output):
        pre_counter[0] += 1
        return None

    b.grad_fn.register_prehook(prehook_none)
    b.sum().backward()
    assert pre_counter[0] == 4
    close(x.grad, np.ones((3, 3)) * 2)


def test_grad_fn_prehooks_multiple_outputs():
    b = a.rand(3, 3, requires_grad=True)
    var, mean = _VarMean.apply(b)
    (var + mean).sum().backward()

    x = b.detach().requires_grad_()
    counter = [0]

    def prehook(grad_output):
        gvar, gmean = grad_output
        counter[0] += 1
        return (gvar * 2, gmean * 2)

    var, mean = _VarMean.apply(x)
    mean.grad_fn.register_prehook(prehook)
    (var + mean).sum().backward()
    assert counter[0] == 1
    close(x.grad, arr(b.grad) * 2)

    class DoubleMul2(Function):
        @staticmethod
        def forward(ctx, x, k, y):
            ctx.k = k
            return k * x * 2, k, k * y * 2

        @staticmethod
        def backward(ctx, g1, _k, g2):
            return ctx.k * g1 * 2, None, ctx.k * g2 * 2

    counter = [0]

    def prehook2(grad_output):
        g1, gk, g2 = grad_output
        assert gk is None  # a non-tensor output gets no gradient
        counter[0] += 1
        return (g1 * 2, None, g2 * 2)

    x = a.randn(3, 3, requires_grad=True, seed=1)
    y = a.randn(3, 3, requires_grad=True, seed=2)
    k = 3
    c, _, d = DoubleMul2.apply(x, k, y)
    c.grad_fn.register_prehook(prehook2)
    (c + d).sum().backward()
    assert counter[0] == 1
    close(x.grad, np.full((3, 3), 4.0 * k))
    close(y.grad, np.full((3, 3), 4.0 * k))


@pytest.mark.parametrize("use_custom_function", [True, False])
def test_grad_fn_prehooks_remove_hooks(use_custom_function):
    mul2 = a.mul2(use_custom_function)

    x = a.rand(3, 3, requires_grad=True)
    b = mul2(x)
    counter = [0]

    def prehook(grad_output):
        counter[0] += 1
        return None

    handle = b.grad_fn.register_prehook(prehook)
    b.grad_fn.register_prehook(prehook)
    handle.remove()
    b.sum().backward()
    close(x.grad, np.ones((3, 3)) * 2)
    assert counter[0] == 1

    # removing hooks during backward
    x = a.rand(3, 3, requires_grad=True)
    b = mul2(x)
    counter = [0]

    def prehook1(grad_output):
        handle2.remove()
        handle3.remove()  # removing an already removed hook is fine
        return None

    def prehook2(grad_output):
        counter[0] += 1
        return None

    b.grad_fn.register_prehook(prehook1)  # hooks registered first run first
    handle2 = b.grad_fn.register_prehook(prehook2)
    handle3 = b.grad_fn.register_prehook(prehook2)
    handle3.remove()
    b.sum().backward()
    close(x.grad, np.ones((3, 3)) * 2)
    assert counter[0] == 1


def test_accumulate_grad_posthooks_can_observe_tensor_prehook():
    # post hooks on AccumulateGrad see the gradient as the tensor's pre-hooks changed it
    x = a.t(1.0, requires_grad=True)
    seen = []

    def posthook(gO, gI):
        close(gI[0], arr(x) * 2)
        assert len(gO) == 0
        seen.append("post")

    def prehook(gI):
        close(gI[0], arr(x) * 2)
        assert len(gI) == 1
        seen.append("pre")

    b = x.clone()
    acc = b.grad_fn.next_functions[0][0]
    acc.register_hook(posthook)
    acc.register_prehook(prehook)
    x.register_hook(lambda g: g * 2)
    b.backward()
    assert seen == ["pre", "post"]


def test_accumulate_grad_posthooks_should_not_execute():
    def tensor_prehook(g):
        raise RuntimeError("tensor pre-hook of an input not asked for")

    def posthook(gO, gI):
        raise RuntimeError("AccumulateGrad post-hook of an input not asked for")

    x = a.t(1.0, requires_grad=True)
    x.register_hook(tensor_prehook)
    b = a.t(1.0, requires_grad=True)
    c = x.clone()
    acc = c.grad_fn.next_functions[0][0]
    acc.register_hook(posthook)
    out = x + b + c
    out.sum().backward(inputs=[b])
    close(b.grad, 1.0)


def test_hook_edge_case_when_called_with_grad():
    # grad() runs the tensor hooks of the Nodes it captures at, but not their pre/post hooks
    x = a.t(1.0, requires_grad=True)
    b = x * 2
    c = b * 2
    counts = {"tensor": 0, "pre": 0, "post": 0}

    def count(kind):
        def hook(*args):
            counts[kind] += 1
        return hook

    x.register_hook(count("tensor"))
    b.register_hook(count("tensor"))
    acc = b.grad_fn.next_functions[0][0]
    acc.register_hook(count("post"))
    acc.register_prehook(count("pre"))
    b.grad_fn.register_hook(count("post"))
    b.grad_fn.register_prehook(count("pre"))

    def run(expected, fn):
        counts.update(tensor=0, pre=0, post=0)
        fn()
        assert (counts["tensor"], counts["post"], counts["pre"]) == expected

    run((1, 0, 0), lambda: grad(c, inputs=(b,), retain_graph=True))
    run((2, 1, 1), lambda: grad(c, inputs=(x, b), retain_graph=True))
    run((2, 2, 2), lambda: c.backward(retain_graph=True))
    run((2, 2, 2), lambda: c.backward(inputs=(x, b), retain_graph=True))


def test_backward_hook_relative_ordering():
    # PyTorch's expected order, without the Module full backward hook (not built) and with
    # hpcgrad's Node names: for each leaf, its tensor pre-hook, the AccumulateGrad pre-hook, the
    # post-accumulate-grad hook, then the AccumulateGrad post-hook; each Node's pre-hook before
    # its post-hook; a Node before the Nodes it feeds.
    order = []
    module = hg.nn.Linear(10, 10).double()
    x = a.randn(10, 10, requires_grad=True)
    loss = module(x).sum()
    seen = set()
    stack = [loss.grad_fn]
    count = 0
    while stack:  # every Node once, without recursion
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        count += 1
        name = f"{node.name()}_{count}"
        node.register_prehook(lambda g, name=name: order.append(f"pre_hook_{name}"))
        node.register_hook(lambda gi, go, name=name: order.append(f"post_hook_{name}"))
        stack.extend(n for n, _ in node.next_functions)
    leaves = {"x": x, "weight": module.weight, "bias": module.bias}
    for name, leaf in leaves.items():
        leaf.register_hook(lambda g, name=name: order.append(f"tensor_pre_hook_{name}"))
        leaf.register_post_accumulate_grad_hook(
            lambda t, name=name: order.append(f"post_acc_grad_hook_{name}"))
    loss.backward()

    assert order[0].startswith("pre_hook_") and order[1].startswith("post_hook_")
    assert order[0][len("pre_hook_"):] == order[1][len("post_hook_"):]  # the root Node first
    for name in leaves:
        i = order.index(f"tensor_pre_hook_{name}")
        acc_pre, acc = order[i + 1], order[i + 1][len("pre_hook_"):]
        assert acc_pre.startswith("pre_hook_AccumulateGrad")
        assert order[i + 2] == f"post_acc_grad_hook_{name}"
        assert order[i + 3] == f"post_hook_{acc}"
    for entry in order:
        if entry.startswith("pre_hook_"):
            assert order.index(entry) < order.index("post_hook_" + entry[len("pre_hook_"):])
    assert len(order) == 2 * count + 2 * len(leaves)


def test_callback_adds_callback():
    called = [0]

    def callback_final():
        called[0] += 1

    def callback_adds_callback():
        called[0] += 1
        a.engine().queue_callback(callback_final)

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, input):
            return input

        @staticmethod
        def backward(ctx, grad):
            a.engine().queue_callback(callback_adds_callback)
            return grad

    x = a.rand(3, 3, requires_grad=True)
    MyFunc.apply(x).sum().backward()
    assert called[0] == 2


# --- gradient edges -------------------------------------------------------------------------------

def test_grad_to_node():
    def check_matches(out, inp):
        ref = grad(out.sum(), inp)
        new = grad(out.sum(), get_gradient_edge(inp))
        close(ref[0], new[0])

    # the kinds of Nodes: AccumulateGrad, a built-in op, a custom Function, a multi-output Node
    x = a.rand(2, requires_grad=True)
    check_matches(x.clone(), x)
    x = x.clone()
    check_matches(x.clone(), x)
    x = a.mul2(True)(x)
    check_matches(x.clone(), x)
    x = _VarMean.apply(x.reshape(2, 1))[1]
    check_matches(x.clone(), x)


def test_grad_to_node_multi():
    x = a.rand(2, requires_grad=True, seed=1).clone()
    y = a.rand(2, requires_grad=True, seed=2).clone()
    out = x + y
    ref = grad(out.sum(), (x, y), retain_graph=True)
    inp_edges = (GradientEdge(x.grad_fn, x.output_nr), GradientEdge(y.grad_fn, y.output_nr))
    new = grad(out.sum(), inp_edges)
    close(ref[0], new[0])
    close(ref[1], new[1])


def test_grad_to_node_materialize():
    x = a.rand(2, requires_grad=True, seed=1).clone()
    edge_x = GradientEdge(x.grad_fn, x.output_nr)
    y = a.rand(2, requires_grad=True, seed=2).clone()
    edge_y = GradientEdge(y.grad_fn, y.output_nr)
    out = x.clone()
    grad(out.sum(), (edge_x, y), allow_unused=True, materialize_grads=True, retain_graph=True)
    grad(out.sum(), (x, y), allow_unused=True, materialize_grads=True, retain_graph=True)
    grad(out.sum(), (x, edge_y), allow_unused=True, retain_graph=True)
    with pytest.raises(RuntimeError, match="materialize_grads cannot be used when the given "
                                           "input is a GradientEdge"):
        grad(out.sum(), (x, edge_y), allow_unused=True, materialize_grads=True)


def test_backward_to_node():
    x = a.rand(2, requires_grad=True, seed=1).clone()
    edge_x = GradientEdge(x.grad_fn, x.output_nr)
    y = a.rand(2, requires_grad=True, seed=2).clone()
    edge_y = GradientEdge(y.grad_fn, y.output_nr)
    out = x.clone()
    for inputs in ((edge_x, y), (x, y), (x, edge_y), (edge_x, edge_y)):
        hg.autograd.backward(out.sum(), inputs=inputs, retain_graph=True)


def test_gradient_edge_output():
    # PyTorch's x.sin().cos() ... .exp().clone().sin() written with tanh/exp (hpcgrad has no
    # sin/cos); the test is about edges, not the functions.
    x = a.t([1.0, 2.0], requires_grad=True)

    def fn(x, reduce=True):
        tmp = x.tanh().exp()
        if reduce:
            tmp = tmp.sum()
        out = tmp.exp().clone().tanh().sum()
        return out, get_gradient_edge(tmp)

    # backward in two steps, through the edge
    out, tmp_edge = fn(x)
    tmp_grad, = grad(out, (tmp_edge,))
    x_grad, = grad(tmp_edge, (x,), grad_outputs=(tmp_grad,))
    out, _ = fn(x)
    x_grad_ref, = grad(out, (x,))
    close(x_grad, x_grad_ref)

    out, tmp_edge = fn(x)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        grad(tmp_edge, (x,), grad_outputs=a.t([1.0, 2.0, 3.0, 4.0]))
    out, tmp_edge = fn(x)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        hg.autograd.backward(tmp_edge, inputs=(x,), grad_tensors=a.t([1.0, 2.0, 3.0, 4.0]))


def test_gradient_edge_output_implicit_grad():
    # the rest of test_gradient_edge_output: edges as roots without explicit gradients
    x = a.t([1.0, 2.0], requires_grad=True)

    def fn(x, reduce=True):
        tmp = x.tanh().exp()
        if reduce:
            tmp = tmp.sum()
        out = tmp.exp().clone().tanh().sum()
        return out, get_gradient_edge(tmp)

    # no grad_outputs for a non-scalar edge
    out, tmp_edge = fn(x, reduce=False)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar output"):
        grad(tmp_edge, (x,))
    out, tmp_edge = fn(x, reduce=True)
    grad(tmp_edge, (x,))  # a scalar edge needs none

    # backward() through an edge, compared with grad()
    out, tmp_edge = fn(x)
    hg.autograd.backward(tmp_edge, retain_graph=True)
    x_grad_ref, = grad(tmp_edge, (x,), retain_graph=True)
    close(x.grad, x_grad_ref)

    x.grad = None
    hg.autograd.backward((tmp_edge,), retain_graph=True)  # a tuple of edges
    close(x.grad, x_grad_ref)

    out1, tmp_edge1 = fn(x)  # edges and tensors mixed
    out2, tmp_edge2 = fn(x)
    x_grad_ref, = grad((tmp_edge1, out2), (x,), retain_graph=True)
    x.grad = None
    hg.autograd.backward((tmp_edge1, out2), retain_graph=True)
    close(x.grad, x_grad_ref)


def test_gradient_edge_graph_ownership():
    # the edge keeps its graph alive after the tensor is gone
    class Clone(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, gX):
            return gX.clone()

    inp = a.rand(1, requires_grad=True).clone()
    for make in (lambda t: t.clone(), Clone.apply):  # a built-in Node, a custom Function's Node
        out = make(inp)
        edge = get_gradient_edge(out)
        hg.autograd.backward(edge)
        del out
        gc.collect()
        hg.autograd.backward(edge)
