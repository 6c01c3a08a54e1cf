"""Replayed backward plans (Note [Replayed backward plans]) against the queue engine."""

import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import engine, plan as plan_mod
from hpcgrad.autograd.function import Function
from hpcgrad.utils.checkpoint import checkpoint


@pytest.fixture(autouse=True)
def fresh_plans():
    previous = hg.autograd.set_backward_plan("on")
    engine.plans.clear()
    yield
    hg.autograd.set_backward_plan(previous)
    engine.plans.clear()


def _params(seed=0):
    rng = np.random.default_rng(seed)
    w1 = hg.tensor(rng.standard_normal((4, 5)), requires_grad=True)
    b1 = hg.tensor(rng.standard_normal(5), requires_grad=True)
    w2 = hg.tensor(rng.standard_normal((5, 3)), requires_grad=True)
    return w1, b1, w2


def _loss(params, x):
    w1, b1, w2 = params
    h = (x @ w1 + b1).relu()          # broadcast bias: its gradient is summed back
    out = h @ w2
    return (out * out).sum() + (h * w1.sum()).mean()  # w1 used twice: a shared leaf


def _grads(mode, steps=3):
    hg.autograd.set_backward_plan(mode)
    params = _params()
    x = hg.tensor(np.random.default_rng(1).standard_normal((6, 4)))
    history = []
    for _ in range(steps):
        for p in params:
            p.grad = None
        _loss(params, x).backward()
        history.append([p.grad.numpy().copy() for p in params])
    return history


def test_replay_equals_queue_engine_bitwise():
    on = _grads("on")
    stats = dict(engine.plans.stats)
    off = _grads("off")
    for a_step, b_step in zip(on, off):
        for a, b in zip(a_step, b_step):
            np.testing.assert_array_equal(a, b)
    assert stats["built"] == 1 and stats["replayed"] == 2  # one plan, then replays


def _record_order(build):
    order = []
    root = build()
    seen, stack = set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda grads, node=node: order.append(node.name()) or None)
        stack.extend(e.node for e in node.next_edges if e is not None)
    root.backward()
    return order


def _branchy(flip):
    def build():
        # New leaves each time: AccumulateGrad Nodes live with their leaf, and their hooks too.
        x = hg.tensor(np.arange(3.0), requires_grad=True)
        y = hg.tensor(np.ones(3), requires_grad=True)
        # The same structure either way; only the order the two branches are created in differs.
        if flip:
            b = (y * 3.0).exp()
            a = (x * 2.0).sin()
        else:
            a = (x * 2.0).sin()
            b = (y * 3.0).exp()
        return (a * b + a).sum()
    return build


@pytest.mark.parametrize("flip", [False, True])
def test_order_follows_queue_engine(flip):
    build = _branchy(flip)
    hg.autograd.set_backward_plan("off")
    expected = _record_order(build)
    hg.autograd.set_backward_plan("on")
    first = _record_order(build)   # built now
    second = _record_order(build)  # matched and replayed
    assert first == expected and second == expected
    assert engine.plans.stats["replayed"] >= 1


def test_same_structure_other_creation_order_gets_its_own_plan():
    hg.autograd.set_backward_plan("off")
    expected = [_record_order(_branchy(flip)) for flip in (False, True)]
    assert expected[0] != expected[1]
    hg.autograd.set_backward_plan("on")
    assert [_record_order(_branchy(flip)) for flip in (False, True)] == expected
    assert engine.plans.stats["built"] == 2  # the ranking of sequence numbers differs


def test_sharing_differs_no_match():
    x = hg.tensor(np.ones(2), requires_grad=True)
    ((x * 2.0) + (x * 3.0)).sum().backward()   # two Mul Nodes
    plan_a = engine.plans._plans[type(((x * 1.0).sum()).grad_fn)][0]
    x.grad = None
    m = x * 2.0
    (m + m).sum().backward()                     # one Mul Node, shared
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0])
    assert len(plan_a) == 5 and engine.plans.stats["built"] == 2


def test_match_rejects_each_kind_of_difference():
    x = hg.tensor(np.ones(2), requires_grad=True)
    p, _ = plan_mod.build(((x * 2.0) + 1.0).sum().grad_fn)
    assert plan_mod.match(p, ((x * 2.0) + 1.0).sum().grad_fn) is not None
    assert plan_mod.match(p, ((x * 2.0) - 1.0).sum().grad_fn) is None       # a type
    assert plan_mod.match(p, ((x * 2.0) + 1.0).mean().grad_fn) is None      # the root type
    y = hg.tensor(np.ones(2), requires_grad=True)
    assert plan_mod.match(p, ((x * y) + 1.0).sum().grad_fn) is None         # an edge
    assert plan_mod.match(p, ((x * 2.0) + 1.0 + 1.0).sum().grad_fn) is None  # a Node more


def test_plan_keeps_no_nodes_alive():
    x = hg.tensor(np.ones(3), requires_grad=True)
    s = (x * 2.0).exp().sum()
    ref = weakref.ref(s.grad_fn)
    s.backward()
    del s
    gc.collect()
    assert ref() is None and engine.plans.stats["built"] == 1


def test_hooks_added_between_replays_run():
    x = hg.tensor(np.ones(3), requires_grad=True)
    for step in range(3):
        y = x * 2.0
        seen = []
        if step == 2:
            y.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 10.0)
        x.grad = None
        (y * y).sum().backward()
        expected = 8.0 * (10.0 if step == 2 else 1.0)
        np.testing.assert_array_equal(x.grad.numpy(), np.full(3, expected))
    np.testing.assert_array_equal(seen[0], np.full(3, 4.0))
    assert engine.plans.stats["replayed"] == 2


def test_error_in_replay_names_node_and_next_backward_works():
    class Boom(Function):
        fail = False

        @staticmethod
        def forward(ctx, a):
            return a.array * 1.0

        @staticmethod
        def backward(ctx, g):
            if Boom.fail:
                raise ValueError("boom")
            return g

    x = hg.tensor(np.ones(2), requires_grad=True)
    for _ in range(2):
        Boom.apply(x * 2.0).sum().backward()
    Boom.fail = True
    with pytest.raises(ValueError, match="boom") as info:
        Boom.apply(x * 2.0).sum().backward()
    assert "BoomBackward" in "".join(getattr(info.value, "__notes__", []))
    Boom.fail = False
    x.grad = None
    Boom.apply(x * 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0])
    assert engine.plans.stats["replayed"] >= 2


def test_retain_graph_and_release():
    x = hg.tensor(np.ones(2), requires_grad=True)
    for _ in range(2):
        x.grad = None
        s = (x * x).sum()
        s.backward(retain_graph=True)
        s.backward()
        np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            s.backward()


def test_final_callbacks_and_current_task():
    x = hg.tensor(np.ones(2), requires_grad=True)
    ran = []
    for _ in range(3):
        y = x * 3.0
        y.register_hook(lambda g: engine.Engine.queue_callback(lambda: ran.append(1)) or None)
        (y * 1.0).sum().backward()
    assert ran == [1, 1, 1] and engine.plans.stats["replayed"] == 2
    assert engine.current_graph_task() is None


def test_reentrant_checkpoint_replayed():
    w = hg.tensor(np.random.default_rng(0).standard_normal((3, 3)), requires_grad=True)
    x = hg.tensor(np.ones((2, 3)))

    def grads(mode):
        hg.autograd.set_backward_plan(mode)
        out = []
        for _ in range(3):
            w.grad = None
            checkpoint(lambda t, v: (t @ v).tanh() @ v, x, w, use_reentrant=True).sum().backward()
            out.append(w.grad.numpy().copy())
        return out

    for a, b in zip(grads("on"), grads("off")):
        np.testing.assert_array_equal(a, b)


def test_anomaly_nan_in_replay():
    x = hg.tensor(np.array([0.0, 1.0]), requires_grad=True)
    with hg.autograd.detect_anomaly():
        (x * 1.0).sqrt().sum().backward()  # inf, not nan: passes, and plans the graph
        with pytest.raises(RuntimeError, match="returned nan values"):
            ((x * 0.0) * float("inf")).sum().backward()
            ((x * 0.0) * float("inf")).sum().backward()


def test_multiple_roots():
    x = hg.tensor(np.ones(2), requires_grad=True)
    for _ in range(3):
        x.grad = None
        a, b = (x * 2.0).sum(), (x * 3.0).sum()
        hg.autograd.backward([a, b])
        np.testing.assert_array_equal(x.grad.numpy(), [5.0, 5.0])
    assert engine.plans.stats["replayed"] == 2


def test_grad_and_inputs_use_queue_engine():
    x = hg.tensor(np.ones(2), requires_grad=True)
    (g,) = hg.autograd.grad((x * x).sum(), [x])
    (x * x).sum().backward(inputs=[x])
    np.testing.assert_array_equal(g.numpy(), [2.0, 2.0])
    assert engine.plans.stats["built"] == 0 and engine.plans.stats["general"] >= 2


def test_mode_errors():
    with pytest.raises(ValueError, match="expected one of on, off"):
        hg.autograd.set_backward_plan("sometimes")
    assert hg.autograd.set_backward_plan(False) == "on"
    assert hg.autograd.set_backward_plan(True) == "off"


def test_env_mode(monkeypatch):
    monkeypatch.setenv("HPCGRAD_BACKWARD_PLAN", "0")
    assert plan_mod.PlanCache().mode == "off"
    monkeypatch.setenv("HPCGRAD_BACKWARD_PLAN", "maybe")
    with pytest.raises(ValueError, match="HPCGRAD_BACKWARD_PLAN='maybe'"):
        plan_mod.PlanCache()


def test_replay_sums_broadcast_gradient_beside_dropped_edge():
    # Add, Mul and Sub Nodes whose other input is a constant (a None edge) while the live
    # edge's gradient must be summed back to a broadcast shape: the replay's slow path.
    d = np.arange(4.0).reshape(4, 1)
    for mode in ("on", "off"):
        hg.autograd.set_backward_plan(mode)
        engine.plans.clear()
        w = hg.tensor(np.ones((1, 3)), requires_grad=True)
        c = hg.tensor(np.full((4, 3), 2.0))
        for _ in range(3):
            w.grad = None
            (((w + c) * hg.tensor(d)) - c).sum().backward()
            # d/dw sum((w + c) * d - c) = the column sums of d, in every column
            np.testing.assert_array_equal(w.grad.numpy(), np.full((1, 3), d.sum()))
        if mode == "on":
            assert engine.plans.stats["replayed"] == 2


def test_tensor_operators_record_as_function_apply():
    # Tensor's operators call an apply made for their two (or one) Tensor arguments
    # (function._tensor_apply): the same graph and results as Function.apply.
    x = hg.tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    y = hg.tensor(np.array([4.0, 5.0, -6.0]))
    out = (x * y) + (x - y) / 2.0 - (-x) * 3
    assert type(out.grad_fn).__name__ == "SubBackward0"
    out.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), y.numpy() + 0.5 + 3.0)
    assert (y * y).grad_fn is None and not (y * y).requires_grad
    with hg.no_grad():
        z = x * y - x
        assert z.grad_fn is None and not z.requires_grad
    xv = x.detach().numpy()
    np.testing.assert_array_equal(z.numpy(), xv * y.numpy() - xv)
    # create_graph=True records the formulas' operators: a second derivative
    x.grad = None
    (g,) = hg.autograd.grad((x * x * x).sum(), x, create_graph=True)
    g.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * xv)


# Issue 25: graphs that a plan matched although they differ in what changes the result.

def test_unused_piece_of_chunk_split_unbind():
    for make in (lambda x: x.chunk(2), lambda x: x.split(3), lambda x: x.unbind(0)):
        for _ in range(2):  # built, then replayed
            x = hg.tensor(np.arange(6.0), requires_grad=True)
            pieces = make(x)
            pieces[0].sum().backward()
            want = np.zeros(6)
            want[:pieces[0].numel()] = 1.0
            np.testing.assert_array_equal(x.grad.numpy(), want)


def test_split_into_two_then_three_pieces():
    for n in (2, 3, 2, 3):
        x = hg.tensor(np.arange(6.0), requires_grad=True)
        sum((p * p).sum() for p in x.chunk(n)).backward()
        np.testing.assert_array_equal(x.grad.numpy(), 2 * np.arange(6.0))


class _Mean(Function):
    """n copies of x; backward averages the n output gradients (so dx = mean of them)."""

    @staticmethod
    def forward(ctx, x, n):
        return tuple(x * 1.0 for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        return sum(g for g in grads if g is not None) / len(grads), None


def test_custom_function_with_two_then_three_outputs():
    for n in (2, 3, 2):
        x = hg.tensor(np.ones(1), requires_grad=True)
        _Mean.apply(x, n)[0].sum().backward()  # one output used: dx = 1/n
        np.testing.assert_allclose(x.grad.numpy(), [1.0 / n])
