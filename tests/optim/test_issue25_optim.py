"""Issue 25, optimizers and schedulers: a step counts as an in-place write of the parameters it
changes (so a graph from before it refuses to backpropagate), checked against PyTorch."""

import numpy as np
import pytest

import hpcgrad
from hpcgrad import nn
from hpcgrad.autograd import set_backward_plan
from hpcgrad.optim import SGD, Adam, AdamW

INPLACE_MESSAGE = "modified by an inplace operation"

OPTIMIZERS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),  # step 2 takes the fused (numba) path
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3, "maximize": True}),
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.0}),
]
CLASSES = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((4, 3)), "b1": rng.standard_normal(4),
            "w2": rng.standard_normal((2, 4)), "b2": rng.standard_normal(2),
            "x": rng.standard_normal((5, 3))}


def _step_then_backward(lib, name, options, steps=2):
    """Per step: build ``loss`` from the model, ``opt.step()``, then ``loss.backward()``; the
    outcome is the error message, or None. The second Linear saves its weight (its input
    requires grad), so the step has changed a saved tensor."""
    a = _arrays()
    if lib == "torch":
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 2)).double()
        with torch.no_grad():
            for p, key in zip(model.parameters(), ("w1", "b1", "w2", "b2")):
                p.copy_(torch.tensor(a[key]))
        x = torch.tensor(a["x"])
        opt = getattr(torch.optim, name)(model.parameters(), **options)
    else:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        for p, key in zip(model.parameters(), ("w1", "b1", "w2", "b2")):
            p.data = a[key].copy()
        x = hpcgrad.tensor(a["x"])
        opt = CLASSES[name](model.parameters(), **options)
    model(x).sum().backward()
    outcomes = []
    for _ in range(steps):
        loss = model(x).sum()
        opt.step()
        try:
            loss.backward()
            outcomes.append(None)
        except RuntimeError as e:
            outcomes.append(str(e))
        opt.zero_grad()
        model(x).sum().backward()
    return outcomes, [p.detach().numpy().copy() if lib == "torch" else p.data.copy()
                      for p in model.parameters()]


@pytest.mark.parametrize("plan", ["off", "on"])
@pytest.mark.parametrize(("name", "options"), OPTIMIZERS,
                         ids=[f"{n}-{'-'.join(o)}" for n, o in OPTIMIZERS])
def test_backward_after_step_raises_as_torch(name, options, plan):
    previous = set_backward_plan(plan)
    try:
        ours, ours_params = _step_then_backward("hpcgrad", name, options)
    finally:
        set_backward_plan(previous)
    assert all(o is not None and INPLACE_MESSAGE in o for o in ours), ours
    assert "is at version" in ours[0] and "expected version" in ours[0]
    pytest.importorskip("torch")
    theirs, theirs_params = _step_then_backward("torch", name, options)
    assert [o is not None and INPLACE_MESSAGE in o for o in theirs] == [True] * len(theirs)
    for mine, ref in zip(ours_params, theirs_params):  # the recovery steps still agree
        np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-12)


def _version_deltas(lib, name, options, sparse):
    """Each parameter's version change over one step; parameter 1 has no gradient."""
    rng = np.random.default_rng(1)
    init = [rng.standard_normal((5, 3)), rng.standard_normal(3), rng.standard_normal((2, 2))]
    if lib == "torch":
        import torch
        params = [torch.tensor(v, requires_grad=True) for v in init]
        emb_grad = torch.sparse_coo_tensor([[0, 3, 0]], torch.ones(3, 3, dtype=torch.float64),
                                           (5, 3))
        make = torch.tensor
        opt = getattr(torch.optim, name)(params, **options)
    else:
        from hpcgrad.sparse import SparseCOOTensor
        params = [hpcgrad.tensor(v, requires_grad=True) for v in init]
        emb_grad = SparseCOOTensor(np.array([0, 3, 0]), np.ones((3, 3)), (5, 3))
        make = hpcgrad.tensor
        opt = CLASSES[name](params, **options)
    params[0].grad = emb_grad if sparse else make(np.ones((5, 3)))
    params[2].grad = make(np.ones((2, 2)))
    before = [p._version for p in params]
    opt.step()
    return [p._version - v for p, v in zip(params, before)]


@pytest.mark.parametrize(("name", "options", "sparse"),
                         [(n, o, False) for n, o in OPTIMIZERS] + [("SGD", {"lr": 0.1}, True)],
                         ids=[f"{n}-{'-'.join(o)}" for n, o in OPTIMIZERS] + ["SGD-sparse"])
def test_step_bumps_exactly_the_parameters_it_writes(name, options, sparse):
    ours = _version_deltas("hpcgrad", name, options, sparse)
    assert ours == [1, 0, 1]  # once per step; untouched without a gradient
    pytest.importorskip("torch")
    theirs = _version_deltas("torch", name, options, sparse)
    assert [d > 0 for d in theirs] == [True, False, True]


def test_zero_grad_in_place_counts_as_a_write_like_torch():
    """``zero_grad(set_to_none=False)`` writes the gradient (torch's ``grad.zero_()``)."""
    p = hpcgrad.tensor(np.ones(3), requires_grad=True)
    p.grad = hpcgrad.tensor(np.ones(3))
    g = p.grad
    SGD([p], lr=0.1).zero_grad(set_to_none=False)
    assert p.grad is g and g._version == 1 and not g.data.any()
    torch = pytest.importorskip("torch")
    q = torch.ones(3, requires_grad=True)
    q.grad = torch.ones(3)
    v = q.grad._version
    torch.optim.SGD([q], lr=0.1).zero_grad(set_to_none=False)
    assert q.grad._version - v == 1
