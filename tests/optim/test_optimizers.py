"""SGD, Adam and AdamW against torch.optim (float64, several steps), by hand, and their errors."""

import itertools
import math

import numpy as np
import pytest

import hpcgrad
from hpcgrad import nn
from hpcgrad.optim import SGD, Adam, AdamW
from hpcgrad.sparse import SparseCOOTensor

SHAPES = [(3, 4), (5,), ()]
STEPS = 6


def _params_and_grads(seed, steps=STEPS):
    """Initial parameter arrays and a gradient per step; parameter 1 has no gradient at step 2."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(shape) for shape in SHAPES]
    grads = [[rng.standard_normal(shape) for shape in SHAPES] for _ in range(steps)]
    if steps > 2:
        grads[2][1] = None
    return init, grads


def _groups(params, group_options):
    """Two groups: params[:2] with the optimizer's defaults, params[2:] with its own options."""
    return [{"params": params[:2]}, {"params": params[2:], **group_options}]


def _run_hpcgrad(cls, options, group_options, init, grads, state_from=None):
    params = [hpcgrad.tensor(a, requires_grad=True) for a in init]
    opt = cls(_groups(params, group_options), **options)
    if state_from is not None:
        opt.load_state_dict(state_from)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else hpcgrad.tensor(g)
        opt.step()
    return [p.array for p in params], opt


def _run_torch(name, options, group_options, init, grads):
    torch = pytest.importorskip("torch")
    params = [torch.tensor(a, requires_grad=True) for a in init]
    opt = getattr(torch.optim, name)(_groups(params, group_options), **options)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in params]


def check_against_torch(cls, options, group_options=None, seed=0):
    group_options = group_options or {}
    init, grads = _params_and_grads(seed)
    ours, _ = _run_hpcgrad(cls, options, group_options, init, grads)
    theirs = _run_torch(cls.__name__, options, group_options, init, grads)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"parameter {i}")


def _sgd_cases():
    for momentum, dampening, nesterov, wd, maximize in itertools.product(
            (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.05), (False, True)):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        yield dict(lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov,
                   weight_decay=wd, maximize=maximize)


@pytest.mark.parametrize("options", list(_sgd_cases()), ids=str)
def test_sgd_matches_torch(options):
    check_against_torch(SGD, options, group_options={"lr": 0.03})


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("weight_decay, maximize", [(0.0, False), (0.1, False), (0.1, True)])
def test_adam_matches_torch(cls, amsgrad, weight_decay, maximize):
    options = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay,
                   amsgrad=amsgrad, maximize=maximize)
    check_against_torch(cls, options, group_options={"lr": 0.01, "betas": (0.5, 0.9)})


@pytest.mark.parametrize("cls, options", [
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (SGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    (Adam, dict(lr=0.05, amsgrad=True, weight_decay=0.1)),
    (AdamW, dict(lr=0.05, amsgrad=True)),
], ids=["sgd-nesterov", "sgd-dampening", "adam", "adamw"])
def test_state_dict_round_trip_continues_identically(cls, options):
    init, grads = _params_and_grads(seed=1, steps=2 * STEPS)
    first, rest = grads[:STEPS], grads[STEPS:]
    straight, _ = _run_hpcgrad(cls, options, {}, init, grads)
    halfway, opt = _run_hpcgrad(cls, options, {}, init, first)
    saved = opt.state_dict()
    resumed, resumed_opt = _run_hpcgrad(cls, options, {}, halfway, rest, state_from=saved)
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
    # load_state_dict copied the buffers: the two optimizers share no state arrays
    mine = [a for s in resumed_opt.state.values() for a in s.values() if isinstance(a, np.ndarray)]
    theirs = [a for s in opt.state.values() for a in s.values() if isinstance(a, np.ndarray)]
    assert mine and not any(np.shares_memory(a, b) for a in mine for b in theirs)


def test_state_dict_layout_is_pytorchs():
    init, grads = _params_and_grads(seed=2, steps=1)
    _, opt = _run_hpcgrad(SGD, dict(lr=0.1, momentum=0.5), {"lr": 0.2}, init, grads)
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2]]
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.2]
    assert sorted(sd["state"]) == [0, 1, 2] and set(sd["state"][0]) == {"momentum_buffer"}


# --- by hand, no torch ------------------------------------------------------------------------
def test_sgd_momentum_two_steps_by_hand():
    p = hpcgrad.tensor(np.array([1.0, -2.0]), requires_grad=True)
    opt = SGD([p], lr=0.5, momentum=0.9, dampening=0.5, weight_decay=0.1)
    p.grad = hpcgrad.tensor(np.array([0.2, 0.4]))
    opt.step()  # d = g + 0.1 p = [0.3, 0.2]; buf = d (no dampening at first); p -= 0.5 buf
    np.testing.assert_allclose(p.array, [0.85, -2.1], rtol=1e-15)
    opt.step()  # d = [0.285, 0.19]; buf = 0.9 [0.3, 0.2] + 0.5 d; p -= 0.5 buf
    buf = 0.9 * np.array([0.3, 0.2]) + 0.5 * np.array([0.285, 0.19])
    np.testing.assert_allclose(p.array, np.array([0.85, -2.1]) - 0.5 * buf, rtol=1e-15)


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_one_step_by_hand(cls):
    p0, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, -0.25, 0.0])
    lr, eps, wd = 0.1, 1e-8, 0.2
    p = hpcgrad.tensor(p0, requires_grad=True)
    p.grad = hpcgrad.tensor(g)
    cls([p], lr=lr, eps=eps, weight_decay=wd).step()
    if cls is AdamW:  # decay shrinks p; the bias-corrected moments are then g and g**2
        expected = p0 * (1 - lr * wd) - lr * g / (np.abs(g) + eps)
    else:  # the decay enters the gradient
        d = g + wd * p0
        expected = p0 - lr * d / (np.abs(d) + eps)
    np.testing.assert_allclose(p.array, expected, rtol=1e-12)


def test_float32_parameters_stay_float32_and_in_place():
    p = hpcgrad.tensor(np.ones(4, np.float32), requires_grad=True)
    array = p.array
    for opt in (SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), Adam([p])):
        p.grad = hpcgrad.tensor(np.full(4, 0.5, np.float32))
        opt.step()
        opt.step()
        assert p.array is array and array.dtype == np.float32
        assert all(a.dtype == np.float32 for s in opt.state.values() for a in s.values()
                   if isinstance(a, np.ndarray))


def test_gradient_is_not_modified():
    p = hpcgrad.tensor(np.ones(3), requires_grad=True)
    g = np.array([1.0, 2.0, 3.0])
    for opt in (SGD([p], lr=0.1, momentum=0.9), SGD([p], lr=0.1, momentum=0.9, nesterov=True),
                Adam([p]), AdamW([p], amsgrad=True)):
        p.grad = hpcgrad.tensor(g.copy())
        opt.step()
        opt.step()
        np.testing.assert_array_equal(p.grad.array, g)


def test_step_returns_closure_loss():
    p = hpcgrad.tensor(np.ones(2), requires_grad=True)
    opt = SGD([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 2.0
    np.testing.assert_allclose(p.array, [0.8, 0.8])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    p = hpcgrad.tensor(np.ones(2), requires_grad=True)
    q = hpcgrad.tensor(np.ones(2), requires_grad=True)
    opt = SGD([p, q], lr=0.1)
    p.grad = hpcgrad.tensor(np.ones(2))
    opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert p.grad is None
    else:
        np.testing.assert_array_equal(p.grad.array, [0.0, 0.0])
    assert q.grad is None


# --- sparse gradients ---------------------------------------------------------------------------
def _sparse_grad(shape):
    """A row-sparse gradient with a repeated row (which must accumulate), and its dense form."""
    rows = np.array([3, 0, 3])
    values = np.arange(rows.size * shape[1], dtype=np.float64).reshape(rows.size, shape[1])
    dense = np.zeros(shape)
    np.add.at(dense, rows, values)
    return SparseCOOTensor(rows, values, shape), dense


@pytest.mark.parametrize("options", [dict(lr=0.5), dict(lr=0.5, maximize=True),
                                     dict(lr=0.5, momentum=0.9, weight_decay=0.1)], ids=str)
def test_sgd_sparse_gradient_equals_dense(options):
    shape = (5, 3)
    sparse, dense = _sparse_grad(shape)
    start = np.random.default_rng(3).standard_normal(shape)
    results = []
    for grad in (sparse, hpcgrad.tensor(dense)):
        p = hpcgrad.tensor(start, requires_grad=True)
        opt = SGD([p], **options)
        for _ in range(2):
            p.grad = grad
            opt.step()
        results.append(p.array)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-15)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_on_sparse_embedding_equals_dense(momentum):
    """nn.Embedding(sparse=True) hands SGD a SparseCOOTensor; the weights follow the dense run."""
    tokens = hpcgrad.tensor(np.array([[1, 4, 4], [0, 1, 7]]))
    weights = []
    for sparse in (True, False):
        hpcgrad.manual_seed(0)
        embedding = nn.Embedding(10, 3, sparse=sparse)
        opt = SGD(embedding.parameters(), lr=0.1, momentum=momentum)
        for _ in range(3):
            opt.zero_grad()
            (embedding(tokens) ** 2).sum().backward()
            assert getattr(embedding.weight.grad, "is_sparse", False) is sparse
            opt.step()
        weights.append(embedding.weight.array)
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6)


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_refuses_sparse_gradients(cls):
    dense = hpcgrad.tensor(np.zeros(2), requires_grad=True)
    dense.grad = hpcgrad.ones(2, dtype=np.float64)
    p = hpcgrad.tensor(np.zeros((5, 3)), requires_grad=True)
    p.grad, _ = _sparse_grad((5, 3))
    with pytest.raises(RuntimeError, match=f"^{cls.__name__} does not support sparse gradients, "
                                           "please consider SparseAdam instead"):
        cls([dense, p]).step()
    assert not dense.array.any(), "a refused step updates nothing"


# --- errors ---------------------------------------------------------------------------------------
def _param():
    return hpcgrad.tensor(np.zeros(2), requires_grad=True)


@pytest.mark.parametrize("make, message", [
    (lambda: SGD([_param()], lr=-0.1), "Invalid learning rate: -0.1"),
    (lambda: Adam([_param()], lr=-1), "Invalid learning rate: -1"),
    (lambda: SGD([_param()], momentum=-0.5), "Invalid momentum value: -0.5"),
    (lambda: SGD([_param()], lr=0.1, nesterov=True), "Nesterov momentum requires a momentum"),
    (lambda: SGD([_param()], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     "and zero dampening"),
    (lambda: Adam([_param()], betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0"),
    (lambda: AdamW([_param()], eps=-1.0), "Invalid epsilon value: -1.0"),
    (lambda: Adam([_param()], weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (lambda: SGD([], lr=0.1), "optimizer got an empty parameter list"),
], ids=["sgd-lr", "adam-lr", "momentum", "nesterov", "nesterov-dampening", "beta", "eps", "wd",
        "empty"])
def test_invalid_options(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make()


def test_parameter_in_two_groups_and_wrong_types():
    p = _param()
    opt = SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [p]})
    with pytest.raises(TypeError, match="iterable of Tensors or dicts, but got Tensor"):
        SGD(p, lr=0.1)
    with pytest.raises(TypeError, match="ordered collections"):
        SGD([{"params": {p}}], lr=0.1)
    with pytest.raises(TypeError, match="can only optimize Tensors, but one of the params is ndarray"):
        SGD([np.zeros(2)], lr=0.1)


def test_add_param_group_fills_defaults():
    opt = SGD([_param()], lr=0.1, momentum=0.9)
    opt.add_param_group({"params": [_param()], "lr": 0.01})
    assert opt.param_groups[1]["lr"] == 0.01 and opt.param_groups[1]["momentum"] == 0.9


@pytest.mark.parametrize("other_groups, message", [
    (lambda: [{"params": [_param()]}, {"params": [_param()]}],
     "different number of parameter groups: 1 saved, 2 in this optimizer"),
    (lambda: [{"params": [_param(), _param()]}],
     "doesn't match the size of optimizer's group: group 0 has 1 parameters saved, 2 here"),
    (lambda: [{"params": [hpcgrad.tensor(np.zeros(3), requires_grad=True)]}],
     r"'momentum_buffer' of shape \(2,\) for parameter 0, but that parameter has shape \(3,\)"),
], ids=["groups", "group-size", "shape"])
def test_load_state_dict_mismatch(other_groups, message):
    p = _param()
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = hpcgrad.tensor(np.ones(2))
    opt.step()
    other = SGD(other_groups(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(opt.state_dict())


def test_adam_bias_correction_uses_step_count():
    # After t steps of a constant gradient g, m/(1-b1^t) = g and v/(1-b2^t) = g^2 exactly in math.
    p = hpcgrad.tensor(np.array([0.0]), requires_grad=True)
    opt = Adam([p], lr=0.1, eps=0.0)
    for _ in range(5):
        p.grad = hpcgrad.tensor(np.array([3.0]))
        opt.step()
    assert opt.state[p]["step"] == 5
    assert math.isclose(p.array[0], -0.5, rel_tol=1e-12)
