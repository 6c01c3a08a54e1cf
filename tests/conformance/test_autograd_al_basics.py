"""Ports of PyTorch's TestAutograd backward/grad tests (test_a*..test_l*): accumulation, grad.

Left out (hpcgrad does not build them): in-place ops, views and version counters
(test_copy_slices_graph_task_updates, test_inplace*, test_detach_base, the detach_ part of
test_detach, test_index_backward_does_not_save_tensor, test_first_grad_fn_access_in_no_grad_mode),
complex dtypes (test_dir), is_grads_batched (test_grad_batched_grad), grad_dtype
(test_grad_dtype), private engine and node introspection (test_current_graph_task_id,
test_current_graph_task_execution_order, test_current_node, test_grad_fn_input_metadata,
test_grad_fn_attr_bindings, test_calculate_shape_util), profiler (test_*profiler*,
test_record_function*), nested tensors; and what other modules already port: grad modes in
test_grad_mode.py (test_enable_grad_decorator_no_paren, test_grad_mode_restored_reentrant,
test_grad_mode_class_decoration as test_decorating_a_class_wraps_its_constructor_with_a_warning),
second backwards in test_autograd_saved.py (test_backward_twice_*, test_free_unneeded_tensor),
test_gradcheck_* in test_gradcheck_pytorch.py, test_integer_outputs in the m-z ports.
"""

import threading
import warnings
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, grad
from hpcgrad.sparse import SparseCOOTensor

import autograd_al_helpers as a

close = a.close
arr = a.arr

# PyTorch warns there too; test_backward_create_graph_warns checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


def _zero_grads(*tensors):
    with hg.no_grad():
        for x in tensors:
            x.grad.zero_()


# --- accumulation into .grad ------------------------------------------------------------------

@pytest.mark.parametrize("create_graph", [False, True])
def test_accumulate_grad(create_graph):
    x = a.randn(5, 5, requires_grad=True)
    y = x + 2
    y.backward(a.ones(5, 5), retain_graph=True)
    x_grad = x.grad
    x_grad_clone = x.grad.clone()
    y.backward(a.ones(5, 5), create_graph=create_graph)
    if create_graph:  # accumulated out of place: the first .grad object is left as it was
        close(x_grad, x_grad_clone)
    else:  # accumulated in place into the same .grad object
        close(x_grad, arr(x_grad_clone) * 2)


def _sparse(values):
    """PyTorch's sparse_coo_tensor([[1, 1]], values), as hpcgrad's row-sparse gradient type."""
    values = np.asarray(values, np.float64)
    return SparseCOOTensor(np.array([1, 1]), values, (2,) + values.shape[1:])


def _dense():
    return hg.tensor(np.array([1.5, 1.5]))


@pytest.mark.parametrize("case,create_graph", [
    ("dense_into_sparse", False),
    ("dense_into_sparse", True),
    ("dense_into_dense", False),
    ("dense_into_dense", True),
    ("sparse_into_sparse", False),
    ("sparse_into_sparse", True)])
def test_accumulate_grad_tensor_reference(case, create_graph):
    if case == "sparse_into_sparse":
        # backward() takes no sparse grad_tensors in hpcgrad: the sparse gradient comes from
        # embedding(sparse=True) instead, on a (2, 1) leaf (rows of a 2-D weight).
        params = hg.tensor(np.array([[1.5], [1.5]]), requires_grad=True)
        params.grad = _sparse([[1.0], [1.0]])
        grad_saved = params.grad
        out = hg.nn.functional.embedding(hg.tensor(np.array([1, 1])), params, sparse=True)
        out.sum().backward(create_graph=create_graph)
        assert (params.grad is grad_saved) == (not create_graph)
        close(params.grad.to_dense(), [[0.0], [4.0]])
        return
    params = hg.tensor(np.array([1.5, 1.5]), requires_grad=True)
    params.grad = _sparse([1.0, 1.0]) if case == "dense_into_sparse" else _dense()
    grad_saved = params.grad
    params.backward(_dense(), create_graph=create_graph)
    # dense into sparse never accumulates in place; dense into dense only without create_graph
    assert (params.grad is grad_saved) == (case == "dense_into_dense" and not create_graph)
    close(params.grad, [1.5, 3.5] if case == "dense_into_sparse" else [3.0, 3.0])


def test_accumulate_grad_with_zero_numel_grad():
    x = a.rand(4, 0, requires_grad=True)
    b = a.rand(4, 1, requires_grad=True)
    c = x + b
    assert c.shape == (4, 0)
    c.sum().backward()
    close(b.grad, np.zeros((4, 1)))
    close(x.grad, np.zeros((4, 0)))


# --- grad and second derivatives --------------------------------------------------------------

def _quadratic():
    x = a.randn(2, 2, requires_grad=True, seed=1)
    y = a.randn(2, 2, requires_grad=True, seed=2)
    return x, y, x ** 2 + y * x + y ** 2


def test_hessian_vector():
    x, y, z = _quadratic()
    z.backward(a.ones(2, 2), create_graph=True)
    x_grad = 2 * arr(x) + arr(y)
    y_grad = arr(x) + 2 * arr(y)
    close(x.grad, x_grad)
    close(y.grad, y_grad)
    grad_sum = 2 * x.grad + y.grad
    grad_sum.backward(a.ones(2, 2))
    close(x.grad, x_grad + 5)
    close(y.grad, y_grad + 4)


def test_grad():
    x, y, z = _quadratic()
    z.backward(a.ones(2, 2), create_graph=True)
    x_grad = 2 * arr(x) + arr(y)
    y_grad = arr(x) + 2 * arr(y)
    close(x.grad, x_grad)
    close(y.grad, y_grad)
    grad_sum = 2 * x.grad + y.grad
    x_hv = grad(outputs=[grad_sum], grad_outputs=[a.ones(2, 2)], inputs=[x], create_graph=True)
    close(x_hv[0], np.full((2, 2), 5.0))
    close(x.grad, x_grad)  # grad() leaves .grad alone
    close(y.grad, y_grad)
    with pytest.raises(RuntimeError, match=r"Mismatch in shape: grad_output\[0\] has a shape of "
                                           r".*2.* and output\[0\] has a shape of .*2, 2"):
        grad(outputs=[grad_sum], grad_outputs=[a.ones(2)], inputs=[x], create_graph=True)


def test_grad_nonleaf():
    x_init = a.randn(2, 2, requires_grad=True, seed=1)
    x = x_init
    y = a.randn(2, 2, requires_grad=True, seed=2)
    grad_output = a.ones(2, 2)

    def fn(x):
        return x ** 2 + y * x + y ** 2

    for _ in range(5):
        grad_x, = grad(fn(x), x, grad_outputs=grad_output, create_graph=True)
        assert y.grad is None
        assert x.grad is None
        close(grad_x, 2 * arr(x) + arr(y))
        x = x + 0.05 * grad_x

    assert fn(x).sum().item() > fn(x_init).sum().item()
    x.backward(grad_output)
    assert y.grad is not None
    assert x_init.grad is not None


def test_grad_nonleaf_many_outputs():
    # Two gradients of one Node captured at once (x.chunk(2) written as two slices).
    x = a.randn(4, 2, requires_grad=True)
    ga, gb = x[0:2], x[2:4]
    hook_called = [False]

    def hook(*grads):
        hook_called[0] = True

    x.register_hook(hook)
    go = a.randn(2, 2, seed=1)
    grad_a, grad_b = grad(ga + 2 * gb, [ga, gb], grad_outputs=go, create_graph=True)
    close(grad_a, go)
    close(grad_b, arr(go) * 2)
    assert not hook_called[0]
    assert x.grad is None


class _Unbind(Function):
    """x.unbind() as one multi-output Node, as PyTorch's UnbindBackward0 (hpcgrad has no unbind)."""

    @staticmethod
    def forward(ctx, x):
        return tuple(x.array[i].copy() for i in range(x.shape[0]))

    @staticmethod
    def backward(ctx, *grads):
        return hg.stack(list(grads))


def test_grad_nonleaf_register_hook():
    # A hook on one output of a multi-output Node, then backward through the other outputs:
    # the hook sees an undefined (None) gradient and nothing breaks.
    x = a.randn(5, requires_grad=True)
    x_list = _Unbind.apply(x)
    hook_results = [None]

    def hook(grad):
        hook_results[0] = grad

    x_list[0].register_hook(hook)
    x_list[0].backward()
    close(hook_results[0], 1.0)
    expected_grad = np.array([1.0, 0, 0, 0, 0])
    close(x.grad, expected_grad)
    assert x_list[0].grad is None
    for i in range(1, 5):
        x_list[i].backward()
        assert hook_results[0] is None
        expected_grad[i] = 1.0
        close(x.grad, expected_grad)
        assert x_list[i].grad is None


def test_grad_materialize_grads():
    x = a.t(0.5, requires_grad=True)
    w = a.t(1.0, requires_grad=True)
    y = x * w
    dydx = grad(y, x, create_graph=True)
    d2ydx2_none = grad(dydx, x, create_graph=True, allow_unused=True)
    d2ydx2 = grad(dydx, x, create_graph=True, allow_unused=True, materialize_grads=True)
    d3ydx3 = grad(d2ydx2, x, materialize_grads=True)  # allow_unused implied
    assert d2ydx2_none[0] is None
    assert d2ydx2[0].item() == 0
    assert d3ydx3[0].item() == 0
    with pytest.raises(ValueError, match="Expected allow_unused to be True or not passed when"):
        grad(y, x, allow_unused=False, materialize_grads=True)


def test_grad_badcalls():
    x = a.ones(1)
    y = x ** 2
    with pytest.raises(RuntimeError, match="does not require grad"):
        grad(x, y)
    with pytest.raises(RuntimeError, match="does not require grad"):
        grad(y, x)
    x = a.ones(1, requires_grad=True)
    y = x ** 2
    close(grad(y, x)[0], [2.0])


def test_grad_empty_inputs():
    x = a.t([1.0], requires_grad=True)
    with pytest.raises(ValueError, match="grad requires non-empty inputs."):
        grad(2 * x, [], grad_outputs=a.t([1.0]))


def test_grad_fn_badcalls():
    x = a.ones(1, requires_grad=True)
    y = x ** 2
    with pytest.raises(TypeError, match="expected .* arguments, got .* instead"):
        y.grad_fn(x.detach(), x.detach())  # too many
    with pytest.raises(TypeError, match="expected .* arguments, got .* instead"):
        y.grad_fn()  # too few
    # hpcgrad's Pow Node has an input for the exponent too (None here: it needs no gradient)
    out = y.grad_fn(x.detach())
    close(out[0] if isinstance(out, tuple) else out, [2.0])


def test_grad_unreachable():
    x = a.ones(1, requires_grad=True)
    y = a.ones(1, requires_grad=True)
    x * 2, y * 2  # x and y get grad accumulators
    grad_x, grad_y = grad(x * 2, [x, y], allow_unused=True)
    close(grad_x, arr(x) * 2)
    assert grad_y is None

    # z has no grad accumulator at all
    z = a.ones(1, requires_grad=True)
    grad_x, grad_z = grad(x * 2, [x, z], allow_unused=True)
    close(grad_x, arr(x) * 2)
    assert grad_z is None

    with pytest.raises(RuntimeError, match="Set allow_unused=True"):
        grad(x * 2, [x, y], allow_unused=False)


def test_grad_unreachable_discovery():
    # Nodes that lead to no requested input must not run (PyTorch issue 39784).
    class MyFunc(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, x):
            pytest.fail("This node should not be executed!")

    x = MyFunc.apply(a.randn(1, requires_grad=True) * 2)
    y = a.randn(1, requires_grad=True, seed=1)
    gY, = grad(x, (y,), allow_unused=True)
    assert gY is None

    x = MyFunc.apply(a.randn(1, requires_grad=True) * 2)
    y = a.randn(1, requires_grad=True, seed=1)
    z = a.randn(1, requires_grad=True, seed=2)
    gY, gZ = grad(x + z, (y, z), allow_unused=True)
    assert gY is None
    assert gZ is not None

    x = MyFunc.apply(a.randn(1, requires_grad=True) * 2)
    y = a.randn(1, requires_grad=True, seed=1)
    hg.autograd.backward(x, inputs=(y,))  # allow_unused is implicitly True
    assert y.grad is None


def test_grad_thread_safety():
    def access_grad(tensor, barrier, out, i):
        barrier.wait(timeout=30)
        out[i] = weakref.ref(tensor.grad)

    for _ in range(10):
        tensor = a.t([1.0, 2.0, 3.0], requires_grad=True)
        (tensor ** 2).sum().backward()
        barrier = threading.Barrier(4)
        out = [None] * 4
        threads = [threading.Thread(target=access_grad, args=(tensor, barrier, out, i))
                   for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        for ref in out:
            assert ref() is tensor.grad  # every thread saw the same .grad
        close(tensor.grad, [2.0, 4.0, 6.0])


# --- backward ---------------------------------------------------------------------------------

def test_backward():
    v = a.randn(5, 5, requires_grad=True, seed=1)
    x = a.randn(5, 5, requires_grad=True, seed=2)
    y = a.t(np.random.default_rng(3).random((5, 5)) + 0.1, requires_grad=True)
    z = a.randn(5, 5, requires_grad=True, seed=4)
    grad_output = a.randn(5, 5, seed=5)

    v.backward(grad_output)
    close(v.grad, grad_output)

    s = x + (y * z) + 4 * z ** 2 * x / y
    s.backward(grad_output)
    X, Y, Z, G = arr(x), arr(y), arr(z), arr(grad_output)
    close(x.grad, (4 * Z ** 2 / Y + 1) * G)
    close(y.grad, (Z - 4 * X * Z ** 2 / Y ** 2) * G)
    close(z.grad, (8 * X * Z / Y + Y) * G)


def test_backward_badcalls():
    x = a.ones(1)
    with pytest.raises(RuntimeError, match="does not require grad"):
        x.backward()


def test_backward_with_inputs():
    x = a.randn(2, 2, requires_grad=True, seed=1)
    y = a.randn(2, 2, requires_grad=True, seed=2)

    def fn():
        return x ** 2 + y * x + y ** 2

    gradient = a.ones(2, 2)
    x_grad_expected = 2 * arr(x) + arr(y)
    y_grad_expected = arr(x) + 2 * arr(y)

    hg.autograd.backward(fn(), gradient, inputs=[x, y])
    close(x.grad, x_grad_expected)
    close(y.grad, y_grad_expected)

    _zero_grads(x, y)
    hg.autograd.backward(fn(), gradient, inputs=[x])
    close(x.grad, x_grad_expected)
    close(y.grad, np.zeros((2, 2)))

    _zero_grads(x, y)
    hg.autograd.backward(fn(), gradient, inputs=[y])
    close(y.grad, y_grad_expected)
    close(x.grad, np.zeros((2, 2)))

    _zero_grads(x, y)
    hg.autograd.backward(fn(), gradient, inputs=y)
    close(y.grad, y_grad_expected)
    close(x.grad, np.zeros((2, 2)))

    _zero_grads(x, y)
    with pytest.raises(RuntimeError, match="cannot be empty"):
        hg.autograd.backward(fn(), gradient, inputs=[])


def test_backward_with_scalar_input():
    x = a.randn(requires_grad=True)
    out = x ** 2
    out.backward(inputs=x)
    close(x.grad, 2 * arr(x))


def test_backward_with_nonleaf_inputs():
    x = a.randn(2, 2, requires_grad=True, seed=1)
    x_nonleaf = x * 1
    y = a.randn(2, 2, requires_grad=True, seed=2)
    z = a.randn(2, 2, requires_grad=True, seed=3)
    out = x_nonleaf ** 2 + y * x_nonleaf + y ** 2
    out.backward(a.ones(2, 2), create_graph=True, inputs=[x, y, x_nonleaf])
    close(y.grad, arr(x) + 2 * arr(y))
    close(x.grad, 2 * arr(x) + arr(y))
    close(x_nonleaf.grad, 2 * arr(x_nonleaf) + arr(y))
    # backward has no allow_unused: an input outside the graph just keeps .grad None
    out.backward(a.ones(2, 2), create_graph=True, inputs=[z])
    assert z.grad is None


def test_dependent_backward():
    x = a.randn(10, requires_grad=True)
    y = x ** 2
    z = y ** 3
    go_y = a.randn(10, seed=1)
    go_z = a.randn(10, seed=2)
    hg.autograd.backward([y, z], [go_y, go_z])
    X = arr(x)
    close(x.grad, 2 * X * arr(go_y) + 6 * X ** 5 * arr(go_z))


def test_duplicate_backward_root():
    x0 = a.randn(5, 5, requires_grad=True, seed=1)
    b = a.randn(5, 5, requires_grad=True, seed=2)
    x = x0 * b
    grad_output = a.randn(5, 5, seed=3)
    hg.autograd.backward([x, x], [grad_output, grad_output])
    close(x0.grad, arr(b) * arr(grad_output) * 2)
    close(b.grad, arr(x0) * arr(grad_output) * 2)


def test_backward_no_grad():
    x = a.randn(5, 5, requires_grad=True)
    b = x + 2
    with pytest.raises(RuntimeError):
        hg.autograd.backward([b], [None])  # a non-scalar root needs its gradient


def test_backward_create_graph_warns():
    b = a.randn(3, requires_grad=True)
    c = b * b
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        c.backward(hg.ones_like(c), create_graph=True)
    b.grad = None
    assert any("Using backward() with create_graph=True" in str(w.message) for w in ws)
    with warnings.catch_warnings(record=True) as ws:  # grad() does not warn
        warnings.simplefilter("always")
        grad(c, b, hg.ones_like(c), create_graph=True)
    assert not any("Using backward() with create_graph=True" in str(w.message) for w in ws)


def test_backward_copy():
    # One gradient buffered in three places must be copied before in-place accumulation
    # (a bug of an early PyTorch engine).
    x = a.ones(5, 5, requires_grad=True)
    y = a.ones(5, 5, requires_grad=True)
    p = x + 2
    q = y + 2
    r = x + 2
    add1 = p + q
    add2 = add1 + r
    for _ in range(4):  # a long branch, so grad_output gets buffered
        p = p * 2
        q = q * 2
        r = r * 2
    branch = p + q + r
    out = add2 + branch
    out.backward(a.ones(5, 5))
    close(x.grad, np.full((5, 5), 34.0))  # 16 from p, 16 from r, 2 from add2
    close(y.grad, np.full((5, 5), 17.0))  # 16 from q, 1 from add2


def test_isolated_node():
    x = a.randn(5, 5, requires_grad=True, seed=1)
    y = a.randn(5, 5, requires_grad=True, seed=2)
    s = x + y
    # torch.max(s, 1, True)[1].repeat(1, 5).double(): integer indices, no gradient path
    b = s.argmax(1, keepdim=True).to(np.float64).expand(5, 5)
    o = (b + s).sum()
    o.backward()
    close(x.grad, np.ones((5, 5)))


# --- deep graphs are freed without recursion ---------------------------------------------------

# PyTorch builds 100000-150000 Nodes; 20000 is far past Python's recursion limit (1000) and
# keeps the module fast.
_DEPTH = 20000


def test_free_deep_graph():
    def scope():
        x = a.randn(1, requires_grad=True)
        y = x.clone()
        for _ in range(_DEPTH):
            y = y + y * 0.000001

    scope()  # deleting the chain must not overflow the stack


def test_free_deep_graph_complicated():
    rng = np.random.default_rng(0)

    def scope():
        randchoice = rng.integers(0, 2, (_DEPTH, 2)).astype(np.float64)
        x = a.randn(1, requires_grad=True)
        y = x.clone()
        prev_values = [None, None]
        for i in range(_DEPTH):  # a chain with skip connections (``+=`` written out of place)
            prev_tensors = [t for t in prev_values[:-1] if t is not None]
            prev_values.append(y)
            prev_values.pop(0)
            y = y + y * 0.000001
            if len(prev_tensors) == 2:
                y = y + (hg.tensor(randchoice[i]) * hg.cat(prev_tensors)).sum()

    scope()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # y + y, 20000 times, as in PyTorch
def test_free_deep_graph_pyfunction():
    class MyOp(Function):
        @staticmethod
        def forward(ctx, tensor1, tensor2):
            return tensor1 + tensor2

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, grad_output

    def scope():
        x = a.randn(1, requires_grad=True)
        y = x.clone()
        for _ in range(_DEPTH):
            y = MyOp.apply(y, y)

    scope()


# --- indexing ---------------------------------------------------------------------------------

_INDICES_2D = [
    1, (1, 1), slice(1, None), slice(None, 2), (slice(None, 2), 2), (slice(1, 2), 2),
    (1, slice(2, None)), (slice(None, None), slice(2, None)), np.array([0, 2]),
    np.random.default_rng(0).random((4, 4)) > 0.5, (Ellipsis, slice(2, None)), ([0], [0]),
    ([1, 2, 3], [0]), ([1, 2], [2, 1]), ([[1, 2], [3, 0]], [[0, 1], [2, 3]]),
    (slice(None), [2, 3]), ([2, 3], slice(None)), [0], ([0],)]
_INDICES_3D = [
    (slice(None), [0], [0]), ([0], [0], slice(None)), (slice(None), [0, 1, 2], [0]),
    ([0, 1, 2], [0], slice(None)), (slice(None), [1, 2], [2, 1]), ([1, 2], [2, 1], slice(None)),
    (slice(None), [[1, 2], [2, 0]], [[0, 1], [2, 3]]),
    ([[1, 2], [3, 0]], [[0, 1], [2, 2]], slice(None)), (slice(None), slice(None), [2, 1]),
    (slice(None), [2, 1], slice(None)), ([2, 1], slice(None), slice(None)), ([0],),
    ([0], slice(None)), ([0], Ellipsis), ([1, 2], [0, 1]), ([1, 2], [0, 1], Ellipsis),
    (Ellipsis, [1, 2], [0, 1])]


def _check_index(shape, idx):
    x = np.arange(1.0, 1 + np.prod(shape)).reshape(shape)
    y = a.t(x, requires_grad=True)
    indexed = y[idx]
    close(indexed, x[idx])
    indexed.sum().backward()
    expected_grad = np.zeros(shape)
    expected_grad[idx] = 1
    close(y.grad, expected_grad)


@pytest.mark.parametrize("idx", _INDICES_2D, ids=repr)
def test_indexing(idx):
    _check_index((4, 4), idx)


@pytest.mark.parametrize("idx", _INDICES_3D, ids=repr)
def test_indexing_3d(idx):
    # the second half of PyTorch's test_indexing, on a (4, 3, 4) tensor
    _check_index((4, 3, 4), idx)


def test_indexing_tensor_index():
    # the last case of test_indexing: a (long) Tensor inside the index
    x = np.arange(1.0, 49).reshape(4, 3, 4)
    y = a.t(x, requires_grad=True)
    seq = (hg.tensor(np.array([0, 1])), Ellipsis)
    y[seq].sum().backward()
    expected = np.zeros((4, 3, 4))
    expected[[0, 1]] = 1
    close(y.grad, expected)


@pytest.mark.parametrize("shape,idx", [
    ((4, 4), np.array([1, 1, 3, 2, 1, 2])),
    ((4, 4), ([1, 1, 3, 2, 1, 2], [0])),
    ((4, 4), ([[1, 2], [0, 0]], [[0, 1], [1, 1]])),
    ((4, 4, 4), ([1, 1, 1], slice(None), slice(None)))], ids=repr)
def test_indexing_duplicates(shape, idx):
    # repeated indices add up in the gradient
    y = a.t(np.arange(1.0, 1 + np.prod(shape)).reshape(shape), requires_grad=True)
    y[idx].sum().backward()
    expected = np.zeros(shape)
    np.add.at(expected, idx, 1)
    close(y.grad, expected)
    if shape == (4, 4) and isinstance(idx[0], list) and isinstance(idx[0][0], list):
        close(y.grad, [[0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0]])  # PyTorch's own expected value


def test_diagonal_expanded_v():
    # a.diagonal() written as advanced indexing (hpcgrad has no diagonal); the gradient given is
    # an expanded (stride-0) array, as PyTorch's torch.tensor(value).expand(10).
    value = 0.37
    v_expanded = hg.tensor(np.broadcast_to(np.float64(value), (10,)))
    x = a.rand(10, 10, requires_grad=True)
    diag = x[np.arange(10), np.arange(10)]
    result, = grad(diag, x, v_expanded)
    close(result, np.eye(10) * value)


# --- tensors and nodes --------------------------------------------------------------------------

def test_attribute_deletion():
    x = a.randn(5, 5, requires_grad=True)
    del x.grad
    assert x.grad is None
    with pytest.raises(RuntimeError):
        del x.array
    # PyTorch also refuses `x.data = None` (TypeError): hpcgrad's data is a plain slot, read on
    # every op, so assignments are not checked (README: not built).
    with pytest.raises(RuntimeError):
        del x.requires_grad
    with pytest.raises(RuntimeError):
        del x.grad_fn


def test_detach():
    x = a.randn(10, 10, requires_grad=True)
    y = (x + 2).detach()
    z = y * 4 + 2
    assert not y.requires_grad
    assert not z.requires_grad

    x = a.randn(10, 10, requires_grad=True)
    y = (x * 2).detach()
    assert not y.requires_grad
    assert y.grad_fn is None
    z = x + y
    z.sum().backward()
    # An "incorrect" gradient (y's dependence on x is cut), as the user asked.
    close(x.grad, np.ones((10, 10)))


def test_autograd_print_tensor():
    # PyTorch: "tensor([1.], requires_grad=True)", "tensor([1.], grad_fn=<CloneBackward0>)",
    # "tensor([2.], grad_fn=<FuncBackward>)"; hpcgrad also prints the dtype and names its Nodes.
    x = a.ones(1, requires_grad=True)
    assert repr(x).startswith("tensor([1.]") and repr(x).endswith("requires_grad=True)")
    assert "grad_fn=<" in repr(x.clone()) and "requires_grad" not in repr(x.clone())

    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, x):
            return x

    assert repr(Func.apply(x)).endswith("grad_fn=<FuncBackward>)")


def test_autograd_node_isinstance():
    Node = hg.autograd.graph.Node
    x = a.rand(3, 3, requires_grad=True)
    b = x.exp()
    assert isinstance(b.grad_fn, Node)
    assert issubclass(type(b.grad_fn), Node)
    assert isinstance(b.grad_fn.next_functions[0][0], Node)  # AccumulateGrad
    assert not isinstance(None, Node)
    assert not isinstance(1, Node)
    assert not isinstance(Node, Node)
    assert issubclass(Node, Node)

    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            assert isinstance(ctx, Node)
            return x

        @staticmethod
        def backward(ctx, x):
            assert isinstance(ctx, Node)
            return x

    out = Func.apply(x)
    assert isinstance(out.grad_fn, Node)
    out.sum().backward()
    close(x.grad, np.ones((3, 3)))
