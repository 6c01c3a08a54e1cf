"""Engine behaviours one by one: dependencies, pruning, hooks, callbacks, errors, reentrancy, threads."""

import threading
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, grad
from hpcgrad.autograd.engine import Engine, get_default_engine


def leaf(*values):
    return hg.tensor(np.array(values, dtype=np.float64), requires_grad=True)


def count_runs(node, runs):
    """Record in ``runs`` every time ``node`` runs (a pre-hook sees each execution)."""
    node.register_prehook(lambda grads: runs.append(node.name()))


def test_diamond_counts_dependencies_and_runs_each_node_once():
    x = leaf(1.0, 2.0)
    a, b = x * 2.0, x * 3.0
    c = a + b
    runs = []
    for t in (a, b, c):
        count_runs(t.grad_fn, runs)
    c.sum().backward()
    np.testing.assert_allclose(x.grad.array, [5.0, 5.0])
    assert sorted(runs) == ["AddBackward0", "MulBackward0", "MulBackward0"]


def test_deep_diamond_chain_accumulates_exactly():
    x = leaf(1.0)
    y = x
    for _ in range(50):  # each level doubles the number of paths: gradient 2**50
        y = y * 1.0 + y
    y.backward()
    assert x.grad.item() == 2.0 ** 50


def test_grad_prunes_nodes_off_the_path():
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    side = w.exp()
    out = (x * 2.0).sum() + side.sum()
    runs = []
    count_runs(side.grad_fn, runs)
    (gx,) = grad(out, x)
    np.testing.assert_allclose(gx.array, [2.0, 2.0])
    assert runs == []  # the exp Node leads only to w, which was not asked for
    assert x.grad is None and w.grad is None  # grad() does not accumulate


def test_backward_inputs_fills_only_those_leaves():
    x, w = leaf(1.0), leaf(2.0)
    (x * w).sum().backward(inputs=[x])
    assert x.grad.item() == 2.0 and w.grad is None


def test_backward_inputs_non_leaf_gets_grad():
    x = leaf(3.0)
    h = x * x
    (h * 2.0).sum().backward(inputs=[h])
    assert h.grad.item() == 2.0 and x.grad is None


def test_second_backward_raises_unless_retain_graph():
    x = leaf(2.0)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad.item() == 8.0  # accumulated twice
    with pytest.raises(RuntimeError, match="backward through the graph a second time.*"
                                           "retain_graph=True"):
        y.backward()


def test_tensor_hooks_run_in_order_and_can_be_removed():
    x = leaf(1.0)
    y = x * 3.0
    calls = []
    h1 = y.register_hook(lambda g: calls.append("first") or g * 10)
    y.register_hook(lambda g: calls.append(("second", g.item())))
    leaf_hook = x.register_hook(lambda g: calls.append(("leaf", g.item())))
    y.sum().backward(retain_graph=True)
    assert calls == ["first", ("second", 10.0), ("leaf", 30.0)]
    assert x.grad.item() == 30.0
    h1.remove()
    leaf_hook.remove()
    calls.clear()
    y.sum().backward()
    assert calls == [("second", 1.0)]
    assert x.grad.item() == 33.0


def test_node_pre_and_post_hooks():
    x = leaf(2.0)
    y = x * 5.0
    seen = []
    y.grad_fn.register_prehook(lambda grad_outputs: seen.append("pre") or
                               tuple(g * 2 for g in grad_outputs))
    handle = y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(
        ("post", grad_inputs[0].item(), grad_outputs[0].item())))
    y.backward(retain_graph=True)
    assert seen == ["pre", ("post", 10.0, 2.0)]
    handle.remove()
    y.backward()
    assert seen[-1] == "pre"


def test_accumulate_grad_post_hook_sees_accumulated_grad():
    """The DDP reducer learns a gradient is ready from AccumulateGrad's post-hooks."""
    x = leaf(1.0, 1.0)
    acc = (x * 1.0).grad_fn.next_edges[0].node
    assert acc.name() == "AccumulateGrad" and acc.variable is x
    ready = []
    acc.register_hook(lambda outs, ins: ready.append(x.grad.array.copy()))
    (x * 4.0).sum().backward()
    np.testing.assert_allclose(ready[0], [4.0, 4.0])


def test_retain_grad_on_intermediate():
    x = leaf(1.0, 2.0)
    h = x * x
    h.retain_grad()
    h.sum().backward()
    np.testing.assert_allclose(h.grad.array, [1.0, 1.0])
    np.testing.assert_allclose(x.grad.array, [2.0, 4.0])


def _returning(make, produced):
    """A Function, identity forward, whose backward returns ``make(g)``; a weak reference to
    that array's owner (itself, or the array it views) goes into ``produced`` (a strong one
    would forbid adopting it)."""
    class Tag(Function):
        @staticmethod
        def forward(ctx, a):
            return a.array.copy()

        @staticmethod
        def backward(ctx, g):
            out = make(g)
            produced.append(weakref.ref(out.base if out.base is not None else out))
            return hg.Tensor(out)
    return Tag


def test_fresh_gradient_is_stolen_not_copied():
    x = hg.tensor(np.ones(1000, dtype=np.float32), requires_grad=True)
    produced = []
    tag = _returning(lambda g: g.array * 2, produced)
    tag.apply(x).sum().backward()
    assert x.grad.array is produced.pop()()  # adopted without a copy
    first = x.grad.array
    tag.apply(x).sum().backward()
    assert x.grad.array is first  # the second one is added in place
    np.testing.assert_allclose(x.grad.array, 4.0)


def test_a_fresh_gradient_viewed_in_another_shape_is_stolen_and_a_shared_one_copied():
    """A backward returning a reshape of an array it just made (as a kernel's (K, C*kh*kw)
    result viewed as (K, C, kh, kw)) gives .grad that array without a copy; a view of an array
    something else still holds, or of part of one, is copied, so writing into .grad cannot
    reach it."""
    held = np.arange(12.0)

    def run(make):
        x = hg.tensor(np.ones((3, 4)), requires_grad=True)
        produced = []
        _returning(lambda g: make(), produced).apply(x).sum().backward()
        return x, produced.pop()()

    x, base = run(lambda: np.arange(12.0).reshape(3, 4))
    assert x.grad.array.base is base  # adopted: the fresh array, viewed
    x, base = run(lambda: held.reshape(3, 4))  # a view of an array still held elsewhere
    assert x.grad.array.base is not held and x.grad.array is not held
    x.grad.array[...] = -1
    np.testing.assert_array_equal(held, np.arange(12.0))
    x, _ = run(lambda: np.arange(24.0)[:12].reshape(3, 4))  # part of a fresh array: copied
    assert x.grad.array.base is None
    np.testing.assert_array_equal(x.grad.array, np.arange(12.0).reshape(3, 4))


def test_user_gradient_is_copied_not_aliased():
    x = hg.tensor(np.zeros(3), requires_grad=True)
    g = hg.tensor(np.ones(3))
    x.backward(g)
    assert x.grad.array is not g.array
    x.grad.array += 1
    np.testing.assert_allclose(g.array, 1.0)


def test_final_callbacks_run_after_last_node_and_can_chain():
    x = leaf(1.0)
    order = []
    engine = get_default_engine()

    def second():
        order.append(("second", x.grad.item()))

    def first():
        order.append(("first", x.grad.item()))
        engine.queue_callback(second)

    y = x * 2.0
    y.register_hook(lambda g: engine.queue_callback(first))
    y.sum().backward()
    assert order == [("first", 2.0), ("second", 2.0)]


def test_queue_callback_outside_backward_raises():
    with pytest.raises(RuntimeError, match="only be installed during backward"):
        Engine.queue_callback(lambda: None)


class Boom(Function):
    @staticmethod
    def forward(ctx, a):
        return a.array * 1

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


def test_exception_names_node_and_engine_stays_usable():
    x = leaf(1.0)
    with pytest.raises(ValueError, match="boom in backward") as info:
        Boom.apply(x).sum().backward()
    assert any("BoomBackward" in note for note in info.value.__notes__)
    y = leaf(2.0)
    (y * y).sum().backward()
    assert y.grad.item() == 4.0


def test_validate_outputs_errors_name_the_node():
    class WrongShape(Function):
        @staticmethod
        def forward(ctx, a):
            return a.array.copy()

        @staticmethod
        def backward(ctx, g):
            return hg.Tensor(np.ones(3))

    with pytest.raises(RuntimeError, match=r"Function WrongShapeBackward returned an invalid "
                                           r"gradient at index 0 - got \[3\] but expected "
                                           r"shape compatible with \[2\]"):
        WrongShape.apply(leaf(1.0, 2.0)).sum().backward()

    class WrongCount(Function):
        @staticmethod
        def forward(ctx, a):
            return a.array.copy()

        @staticmethod
        def backward(ctx, g):
            return g, g

    with pytest.raises(RuntimeError, match="WrongCountBackward returned an incorrect number"):
        WrongCount.apply(leaf(1.0)).sum().backward()


def test_broadcast_gradient_is_summed_back():
    class Broadcasting(Function):
        @staticmethod
        def forward(ctx, a):
            return a.array.copy()

        @staticmethod
        def backward(ctx, g):
            return hg.Tensor(np.ones((4, 2)))  # expandable from (2,): summed to (2,)

    x = leaf(1.0, 2.0)
    Broadcasting.apply(x).sum().backward()
    np.testing.assert_allclose(x.grad.array, [4.0, 4.0])


def test_grad_errors():
    x, unused = leaf(1.0), leaf(1.0)
    y = (x * 2.0).sum()
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        grad(y, [x, unused], retain_graph=True)
    gx, gu = grad(y, [x, unused], allow_unused=True, retain_graph=True)
    assert gx.item() == 2.0 and gu is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        grad(y, hg.tensor([1.0]))
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        (x * hg.tensor(np.ones(3))).backward()
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        hg.tensor([1.0]).sum().backward()


def test_create_graph_gives_second_derivative():
    x = leaf(2.0)
    (g,) = grad((x ** 3).sum(), x, create_graph=True)
    assert g.item() == pytest.approx(12.0)
    (gg,) = grad(g.sum(), x)
    assert gg.item() == pytest.approx(12.0)  # d/dx 3x^2 = 6x


def test_deep_chain_needs_no_recursion():
    x = leaf(1.0)
    y = x
    for _ in range(30000):
        y = y + 0.0
    y.backward()
    assert x.grad.item() == 1.0


def test_anomaly_mode_names_node_and_warns_with_forward_stack():
    x = leaf(0.0)
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        anomaly = hg.autograd.detect_anomaly()
    with anomaly, pytest.warns(UserWarning) as warned:
        y = x.sqrt() * 0.0  # d sqrt at 0 -> inf * 0 = nan
        with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan values"):
            y.sum().backward()
    # As PyTorch: "Error detected in <Node>. Traceback of forward call that caused the error:"
    texts = [str(w.message) for w in warned]
    assert any(t.startswith("Error detected in SqrtBackward0. Traceback of forward call") and
               "x.sqrt()" in t for t in texts), texts


class Reentrant(Function):
    """Backward runs a nested backward, as activation checkpointing does."""

    depth_threads = []

    @staticmethod
    def forward(ctx, a, depth):
        ctx.save_for_backward(a)
        ctx.depth = depth
        return a.array.copy()

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        with hg.enable_grad():
            inner = a.detach().requires_grad_()
            out = inner * 3.0
            if ctx.depth > 0:
                out = Reentrant.apply(out, ctx.depth - 1)
            out.sum().backward()
        Reentrant.depth_threads.append((ctx.depth, threading.current_thread().name))
        return g * inner.grad, None


def test_reentrant_backward_runs_nested():
    Reentrant.depth_threads.clear()
    x = leaf(1.0)
    Reentrant.apply(x, 3).sum().backward()
    assert x.grad.item() == 3.0 ** 4  # each level multiplies by 3
    assert {name for _, name in Reentrant.depth_threads} == {threading.current_thread().name}


def test_reentrant_backward_past_max_depth_moves_to_pool_thread(monkeypatch):
    monkeypatch.setattr(Engine, "max_recursion_depth", 2)
    Reentrant.depth_threads.clear()
    x = leaf(1.0)
    Reentrant.apply(x, 5).sum().backward()
    assert x.grad.item() == 3.0 ** 6
    threads = {name for _, name in Reentrant.depth_threads}
    assert any(name.startswith("hpcgrad-autograd-reentrant") for name in threads)


def test_concurrent_backward_on_separate_graphs():
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(30):
                x = hg.tensor(np.full(8, float(k)), requires_grad=True)
                y = x
                for _ in range(50):
                    y = (y * 1.0).tanh() + y * 0.0
                (y * float(k)).sum().backward()
                expected = k * np.prod([1 - np.tanh(v) ** 2 for v in _chain_values(k)])
                results.setdefault(k, []).append(np.allclose(x.grad.array, expected))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert all(all(v) and len(v) == 30 for v in results.values())


def _chain_values(k):
    v, out = float(k), []
    for _ in range(50):
        out.append(v)
        v = np.tanh(v)
    return out


def test_backward_create_graph_keeps_grad_graph_without_aliasing():
    x, y = leaf(2.0), leaf(3.0)
    with pytest.warns(UserWarning, match="reference cycle"):
        (x * x + y).sum().backward(create_graph=True)
    assert x.grad.grad_fn is not None
    (second,) = grad(x.grad.sum(), x)
    assert second.item() == 2.0
    a, b = leaf(1.0), leaf(1.0)
    with pytest.warns(UserWarning):
        (a + b).sum().backward(create_graph=True)
    assert a.grad is not b.grad and a.grad.array is not b.grad.array


def test_deepcopy_and_pickle_of_leaves_are_independent():
    import copy
    import pickle

    x = leaf(1.0, 2.0)
    (x * 2.0).sum().backward()
    clone = copy.deepcopy(x)
    (clone * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad.array, [2.0, 2.0])  # untouched by the copy's backward
    np.testing.assert_allclose(clone.grad.array, [5.0, 5.0])  # copied grad, then accumulated
    restored = pickle.loads(pickle.dumps(x))
    assert restored.requires_grad and restored.grad is None
    np.testing.assert_array_equal(restored.array, x.array)
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(x * 2.0)
