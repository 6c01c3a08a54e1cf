"""Issue 25, optimizers and schedulers: a step counts as an in-place write of the parameters it
changes (so a graph from before it refuses to backpropagate), checked against PyTorch."""

import math

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
            p.array = a[key].copy()
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
    return outcomes, [p.detach().numpy().copy() if lib == "torch" else p.array.copy()
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
    assert p.grad is g and g._version == 1 and not g.array.any()
    torch = pytest.importorskip("torch")
    q = torch.ones(3, requires_grad=True)
    q.grad = torch.ones(3)
    v = q.grad._version
    torch.optim.SGD([q], lr=0.1).zero_grad(set_to_none=False)
    assert q.grad._version - v == 1


# --- a Tensor learning rate in the schedulers ---------------------------------------------------
SCHEDULERS = [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),
    ("ExponentialLR", {"gamma": 0.9}),
    ("MultiStepLR", {"milestones": [2, 4], "gamma": 0.3}),
    ("CosineAnnealingLR", {"T_max": 4, "eta_min": 0.01}),
    ("CosineAnnealingWarmRestarts", {"T_0": 3, "eta_min": 0.01}),
    ("LinearLR", {"start_factor": 0.5, "total_iters": 3}),
    ("PolynomialLR", {"total_iters": 4, "power": 2.0}),
    ("ConstantLR", {"factor": 0.5, "total_iters": 2}),
    ("LambdaLR", {"lr_lambda": lambda epoch: 1.0 / (epoch + 1)}),
]


def _tensor_lr_schedule(lib, name, options, steps=6):
    """SGD with a 0-d Tensor lr under a scheduler; the user writes that Tensor in place after
    the scheduler took its copy. Per step: the lr, the scheduler's base_lrs and last lr, whether
    the group still holds the user's Tensor; and the parameters at the end."""
    if lib == "torch":
        import torch as mod
        from torch.optim import SGD as sgd
    else:
        mod = hpcgrad
        sgd = SGD
    scheduler_cls = getattr(mod.optim.lr_scheduler, name)
    lr = mod.tensor(0.1)
    p = mod.tensor(np.ones(3), requires_grad=True)
    opt = sgd([p], lr=lr, momentum=0.5)
    scheduler = scheduler_cls(opt, **options)
    group = opt.param_groups[0]
    aliases = [group["initial_lr"] is lr, scheduler.base_lrs[0] is lr]
    lr.mul_(3.0)  # the user's write: moves group["lr"] (the same Tensor), not the schedule
    seen = []
    for _ in range(steps):
        p.grad = mod.tensor(np.arange(3.0))
        opt.step()
        scheduler.step()
        seen.append((float(group["lr"]), float(scheduler.base_lrs[0]),
                     float(scheduler.get_last_lr()[0]), group["lr"] is lr,
                     scheduler.get_last_lr()[0] is lr))
    params = p.detach().numpy() if lib == "torch" else p.array
    return aliases, seen, params.copy()


@pytest.mark.parametrize(("name", "options"), SCHEDULERS, ids=[n for n, _ in SCHEDULERS])
def test_scheduler_keeps_a_copy_of_a_tensor_lr_as_torch(name, options):
    aliases, seen, params = _tensor_lr_schedule("hpcgrad", name, options)
    assert aliases == [False, False]
    assert all(still and not last_is for *_, still, last_is in seen)
    pytest.importorskip("torch")
    t_aliases, t_seen, t_params = _tensor_lr_schedule("torch", name, options)
    assert aliases == t_aliases
    for ours, theirs in zip(seen, t_seen):
        np.testing.assert_allclose(ours[:3], theirs[:3], rtol=1e-6)
        assert ours[3:] == theirs[3:]
    np.testing.assert_allclose(params, t_params, rtol=1e-6)


def test_sequential_lr_restores_a_tensor_lr_in_place_as_torch():
    def run(mod):
        lr = mod.tensor(0.2)
        opt = mod.optim.SGD([mod.tensor(np.ones(2), requires_grad=True)], lr=lr)
        sched = mod.optim.lr_scheduler
        s = sched.SequentialLR(opt, [sched.ConstantLR(opt, factor=0.5, total_iters=2),
                                     sched.ExponentialLR(opt, gamma=0.9)], milestones=[2])
        out = []
        for _ in range(4):
            opt.step()
            s.step()
            out.append(float(opt.param_groups[0]["lr"]))
        return out, opt.param_groups[0]["lr"] is lr
    ours, same = run(hpcgrad)
    assert same
    torch = pytest.importorskip("torch")
    theirs, t_same = run(torch)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert t_same


def _plateau(mod, lr):
    opt = mod.optim.SGD([mod.tensor(np.ones(2), requires_grad=True)], lr=lr)
    s = mod.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    out = []
    for metric in (1.0, 2.0, 3.0, 0.5, 0.6):
        s.step(metric)
        value = opt.param_groups[0]["lr"]
        out.append((type(value).__name__, value is lr, float(value),
                    s.get_last_lr()[0] is value, float(s.get_last_lr()[0])))
    return out


def test_reduce_lr_on_plateau_keeps_a_tensor_lr_a_tensor_as_torch():
    ours = _plateau(hpcgrad, hpcgrad.tensor(0.1))
    assert [o[:2] for o in ours] == [("Tensor", True)] * 5  # written in place, not a float
    assert not any(o[3] for o in ours)  # get_last_lr() gives copies
    np.testing.assert_allclose([o[2] for o in ours], [0.1, 0.05, 0.025, 0.025, 0.0125],
                               rtol=1e-6)
    torch = pytest.importorskip("torch")
    theirs = _plateau(torch, torch.tensor(0.1))
    assert [o[:2] for o in ours] == [t[:2] for t in theirs]
    assert [o[3] for o in ours] == [t[3] for t in theirs]
    np.testing.assert_allclose([o[2] for o in ours], [t[2] for t in theirs], rtol=1e-6)
    np.testing.assert_allclose([o[4] for o in ours], [t[4] for t in theirs], rtol=1e-6)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_optimizer_steps_with_a_tensor_lr_as_torch(name):
    """The lr Tensor is read at each step: an in-place change takes effect at the next one."""
    def run(mod, cls):
        lr = mod.tensor(0.1)
        p = mod.tensor(np.linspace(-1.0, 1.0, 4), requires_grad=True)
        opt = cls([p], lr=lr)
        for k in range(3):
            p.grad = mod.tensor(np.array([0.5, -1.0, 2.0, 0.25]) * (k + 1))
            opt.step()
            lr.mul_(0.5)
        return (p.detach().numpy() if mod is not hpcgrad else p.array).copy()
    ours = run(hpcgrad, CLASSES[name])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        CLASSES[name]([hpcgrad.tensor(np.ones(2), requires_grad=True)], lr=hpcgrad.ones(2))
    torch = pytest.importorskip("torch")
    np.testing.assert_allclose(ours, run(torch, getattr(torch.optim, name)), rtol=1e-6)


# --- CyclicLR -----------------------------------------------------------------------------------
CYCLIC = [
    {"mode": "triangular"},
    {"mode": "triangular2"},
    {"mode": "exp_range", "gamma": 0.9},
    {"mode": "triangular", "step_size_down": 2},
    {"scale_fn": lambda x: 1.0 / (x + 1), "scale_mode": "cycle"},
    {"scale_fn": lambda x: 0.95 ** x, "scale_mode": "iterations", "mode": "not-a-mode"},
    {"mode": "triangular2", "cycle_momentum": False},
]


def _cyclic_run(mod, optimizer, options, steps=25, lr=None):
    """lr, momentum (or beta1) of both groups per step, and the parameters at the end."""
    params = [mod.tensor(np.ones(n), requires_grad=True) for n in (3, 2)]
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    if optimizer == "SGD":
        opt = mod.optim.SGD(groups, lr=0.5 if lr is None else lr, momentum=0.5)
        key = "momentum"
    else:
        opt = mod.optim.Adam(groups, lr=0.5 if lr is None else lr)
        key = "betas"
    scheduler = mod.optim.lr_scheduler.CyclicLR(
        opt, base_lr=[0.01, 0.02], max_lr=[0.1, 0.3], step_size_up=3,
        base_momentum=[0.8, 0.7], max_momentum=0.9, **options)
    seen = []
    for k in range(steps):
        for p in params:
            p.grad = mod.tensor(np.full(p.shape, k - 3.0))
        seen.append([(float(g["lr"]), g[key] if key == "momentum" else g[key][0])
                     for g in opt.param_groups] + [list(map(float, scheduler.get_last_lr()))])
        opt.step()
        scheduler.step()
    return seen, [(p.detach().numpy() if mod is not hpcgrad else p.array).copy() for p in params]


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("options", CYCLIC, ids=range(len(CYCLIC)))
def test_cyclic_lr_follows_torch(options, optimizer):
    seen, params = _cyclic_run(hpcgrad, optimizer, options)
    first = seen[0]
    assert first[0][0] == 0.01 and first[1][0] == 0.02  # starts at base_lr ...
    if options.get("cycle_momentum", True):
        assert first[0][1] == 0.9 and first[1][1] == 0.9  # ... and max_momentum
    if options.get("mode") == "triangular" and "step_size_down" not in options:
        assert seen[3][0][0] == pytest.approx(0.1) and seen[6][0][0] == pytest.approx(0.01)
    torch = pytest.importorskip("torch")
    t_seen, t_params = _cyclic_run(torch, optimizer, options)
    assert seen == t_seen  # the same float operations: the same bits
    for mine, ref in zip(params, t_params):
        np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-15)


def test_cyclic_lr_writes_a_tensor_lr_in_place_as_torch():
    def run(mod):
        lr = mod.tensor(0.5)
        opt = mod.optim.SGD([mod.tensor(np.ones(2), requires_grad=True)], lr=lr, momentum=0.5)
        s = mod.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2)
        out = []
        for _ in range(6):
            opt.step()
            s.step()
            out.append(float(lr))
        return out, opt.param_groups[0]["lr"] is lr
    ours, same = run(hpcgrad)
    assert same
    torch = pytest.importorskip("torch")
    theirs, t_same = run(torch)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert t_same


def test_cyclic_lr_state_dict_resumes_the_schedule():
    class Scale:
        def __init__(self):
            self.base = 0.5

        def __call__(self, x):
            return self.base ** x

    def make(fn):
        opt = SGD([hpcgrad.tensor(np.ones(2), requires_grad=True)], lr=0.1, momentum=0.9)
        return opt, hpcgrad.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=2,
                                                       scale_fn=fn)
    fn = Scale()
    opt, s = make(fn)
    for _ in range(5):
        opt.step()
        s.step()
    fn.base = 0.25
    state = s.state_dict()
    assert "_scale_fn_ref" not in state and state["_scale_fn_custom"] == {"base": 0.25}
    opt2, s2 = make(Scale())
    s2.load_state_dict(state)
    for _ in range(4):
        s.step()
        s2.step()
        assert s.get_last_lr() == s2.get_last_lr()
        assert opt.param_groups[0]["momentum"] == opt2.param_groups[0]["momentum"]


class _NoMomentum(hpcgrad.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


def _cyclic_errors(mod, no_momentum):
    """Each bad argument's (exception type, message) from the library ``mod``."""
    p = mod.tensor(np.ones(2), requires_grad=True)
    cyclic = mod.optim.lr_scheduler.CyclicLR
    cases = [
        lambda: cyclic(mod.optim.SGD([p], lr=0.1, momentum=0.9), 0.01, 0.1, mode="sawtooth"),
        lambda: cyclic(no_momentum([p]), 0.01, 0.1),
        lambda: cyclic(mod.optim.SGD([p], lr=0.1, momentum=0.9), [0.01, 0.02], 0.1),
        lambda: cyclic(mod.optim.SGD([p], lr=0.1, momentum=0.9), 0.01, [0.1, 0.2]),
        lambda: cyclic(object(), 0.01, 0.1),
    ]
    out = []
    for case in cases:
        try:
            case()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e), str(e)))
    return out


def test_cyclic_lr_errors_as_torch():
    ours = _cyclic_errors(hpcgrad, _NoMomentum)
    assert [o[0] if o else None for o in ours] == [ValueError] * 4 + [TypeError]
    assert "mode is invalid and scale_fn is None" in ours[0][1]
    assert "must support momentum or beta1" in ours[1][1]
    assert "base_lr must have the same length as optimizer.param_groups" in ours[2][1]
    assert "max_lr must have the same length" in ours[3][1]
    torch = pytest.importorskip("torch")

    class TorchNoMomentum(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    theirs = _cyclic_errors(torch, TorchNoMomentum)
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    for (_, mine), (_, ref) in zip(ours, theirs):
        assert mine.startswith(ref) or ref.startswith(mine.split(":")[0]), (mine, ref)


# --- the fused SGD step against the plain formula -----------------------------------------------
# SGD._fused_step (one numba pass, hpcgrad/base/kernels/cpu.py sgd_step) replaces the numpy path for
# float32/float64 C-contiguous numpy parameters without weight decay, maximize or Nesterov (with
# momentum: from the second step). Each random program runs three ways: the default (fused where
# it applies), the numpy path alone (fused switched off: the same operations, so the same bits),
# and the update rule written out below; then torch.optim, when installed.

def _sgd_reference(p, g, state, o):
    """torch.optim.SGD's single-tensor step, written out in numpy."""
    d = -g if o["maximize"] else g
    if o["weight_decay"]:
        d = d + o["weight_decay"] * p
    if o["momentum"]:
        buf = state.get("buf")
        if buf is None:
            buf = d.copy()
        else:
            buf = buf * o["momentum"] + d * (1 - o["dampening"])
        state["buf"] = buf
        d = d + o["momentum"] * buf if o["nesterov"] else buf
    return p + d * -o["lr"]


def _adam_reference(p, g, state, o, decoupled):
    """torch.optim.Adam/AdamW's single-tensor step, written out in numpy."""
    beta1, beta2 = o["betas"]
    g = -g if o["maximize"] else g
    if o["weight_decay"]:
        if decoupled:
            p = p * (1 - o["lr"] * o["weight_decay"])
        else:
            g = g + o["weight_decay"] * p
    t = state["t"] = state.get("t", 0) + 1
    m = state.get("m", np.zeros_like(p))
    v = state.get("v", np.zeros_like(p))
    m = state["m"] = m + (1 - beta1) * (g - m)
    v = state["v"] = v * beta2 + (1 - beta2) * g * g
    if o["amsgrad"]:
        v = state["vmax"] = np.maximum(state.get("vmax", v), v)
    denom = np.sqrt(v) / math.sqrt(1 - beta2 ** t) + o["eps"]
    return p - o["lr"] / (1 - beta1 ** t) * (m / denom)


def _random_program(seed):
    """An optimizer, its options, initial parameters and per-step gradients (some None, some
    non-contiguous views, which the fused path must leave to the numpy path)."""
    rng = np.random.default_rng(seed)
    name = ["SGD", "SGD", "SGD", "Adam", "AdamW"][seed % 5]
    dtype = np.dtype([np.float32, np.float64][rng.integers(2)])
    if name == "SGD":
        momentum = [0.0, 0.9, 0.5][rng.integers(3)]
        nesterov = bool(momentum and rng.integers(4) == 0)
        options = {"lr": float(rng.uniform(0.01, 0.5)), "momentum": momentum,
                   "dampening": 0.0 if nesterov else [0.0, 0.3][rng.integers(2)],
                   "nesterov": nesterov, "weight_decay": [0.0, 0.0, 0.0, 0.01][rng.integers(4)],
                   "maximize": bool(rng.integers(5) == 0)}
        if seed % 7 == 0:
            dtype = np.dtype(np.float16)  # the numpy path only
    else:
        options = {"lr": float(rng.uniform(1e-3, 0.1)), "betas": (0.9, 0.99), "eps": 1e-8,
                   "weight_decay": [0.0, 0.1][rng.integers(2)], "amsgrad": bool(rng.integers(2)),
                   "maximize": bool(rng.integers(4) == 0)}
    shapes = [tuple(int(n) for n in rng.integers(0 if rng.integers(8) == 0 else 1, 6,
                                                  size=rng.integers(0, 4)))
              for _ in range(rng.integers(1, 4))]  # sizes 0 (empty) to 5, 0-d to 3-d
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = []
    for _ in range(int(rng.integers(3, 7))):
        step = []
        for s in shapes:
            if rng.integers(6) == 0:
                step.append(None)
            elif len(s) >= 2 and rng.integers(3) == 0:  # a transposed (non-contiguous) array
                step.append(rng.standard_normal(s[::-1]).astype(dtype).T)
            else:
                step.append(rng.standard_normal(s).astype(dtype))
        grads.append(step)
    return name, options, init, grads


def _run_program(name, options, init, grads, fused=True):
    params = [hpcgrad.tensor(a.copy(), requires_grad=True) for a in init]
    opt = CLASSES[name](params, **options)
    if not fused:
        opt._fused_step = lambda p, group: False  # the numpy path for every step
    out = []
    for step in grads:
        for p, g in zip(params, step):
            p.grad = None if g is None else hpcgrad.tensor(g)
        opt.step()
        out.append([p.array.copy() for p in params])
    return out


def _run_reference(name, options, init, grads):
    params = [a.copy() for a in init]
    states = [{} for _ in params]
    out = []
    for step in grads:
        for i, g in enumerate(step):
            if g is None:
                continue
            if name == "SGD":
                params[i] = _sgd_reference(params[i], g, states[i], options)
            else:
                params[i] = _adam_reference(params[i], g, states[i], options, name == "AdamW")
            params[i] = params[i].astype(init[i].dtype)
        out.append([p.copy() for p in params])
    return out


def _run_torch(name, options, init, grads):
    import torch
    params = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    opt = getattr(torch.optim, name)(params, **options)
    out = []
    for step in grads:
        for p, g in zip(params, step):
            p.grad = None if g is None else torch.tensor(g.copy(order="C"))
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out


def _tolerance(dtype):
    return {"float16": 2e-3, "float32": 2e-6, "float64": 1e-13}[np.dtype(dtype).name]


@pytest.mark.parametrize("seed", range(60))
def test_fused_sgd_step_equals_the_plain_formula(seed):
    name, options, init, grads = _random_program(seed)
    default = _run_program(name, options, init, grads)
    numpy_path = _run_program(name, options, init, grads, fused=False)
    reference = _run_reference(name, options, init, grads)
    for k, (ours, plain, ref) in enumerate(zip(default, numpy_path, reference)):
        for i, (a, b, r) in enumerate(zip(ours, plain, ref)):
            where = f"{name} {options} {a.dtype} step {k} param {i}"
            assert a.dtype == r.dtype, where
            np.testing.assert_array_equal(a, b, err_msg=where)  # the same arithmetic
            tol = _tolerance(a.dtype)
            np.testing.assert_allclose(a, r, rtol=tol, atol=tol, err_msg=where)
    pytest.importorskip("torch")
    for k, (ours, theirs) in enumerate(zip(default, _run_torch(name, options, init, grads))):
        for i, (a, t) in enumerate(zip(ours, theirs)):
            tol = 5 * _tolerance(a.dtype)
            np.testing.assert_allclose(a, t, rtol=tol, atol=tol,
                                       err_msg=f"{name} {options} step {k} param {i}")


def test_the_fused_sgd_step_runs_and_is_bit_equal(monkeypatch):
    """The programs above do reach the numba kernel (else they compare the numpy path twice)."""
    import hpcgrad.base.kernels.cpu as cpu
    calls = []
    kernel = cpu.sgd_step
    monkeypatch.setattr(cpu, "sgd_step", lambda *args: calls.append(1) or kernel(*args))
    for dtype in (np.float32, np.float64):
        init = [np.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)]
        grads = [[np.full((3, 4), k - 1.5, dtype=dtype)] for k in range(4)]
        for options in ({"lr": 0.1}, {"lr": 0.1, "momentum": 0.9, "dampening": 0.25}):
            before = len(calls)
            fused = _run_program("SGD", options, init, grads)
            assert len(calls) - before == (4 if len(options) == 1 else 3)
            plain = _run_program("SGD", options, init, grads, fused=False)
            for a, b in zip(fused, plain):
                np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_sgd_float16_and_a_fortran_order_momentum_buffer(dtype):
    """Two cases the fused path used to take: float16 (numba has no kernel for it: the step
    raised NotImplementedError), and a momentum buffer loaded in Fortran order (the kernel
    wrote into a reshaped copy: the buffer never moved). Both against the formula and torch."""
    buf = np.asfortranarray(np.arange(12.0, dtype=dtype).reshape(3, 4))
    p0 = np.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)
    options = {"lr": 0.1, "momentum": 0.9}
    p = hpcgrad.tensor(p0.copy(), requires_grad=True)
    opt = SGD([p], **options)
    state = opt.state_dict()
    state["state"] = {0: {"momentum_buffer": buf}}
    opt.load_state_dict(state)
    ref_p, ref_state = p0.copy(), {"buf": buf.copy()}
    for k in range(3):
        g = np.full((3, 4), k + 0.5, dtype=dtype)
        p.grad = hpcgrad.tensor(g)
        opt.step()
        ref_p = _sgd_reference(ref_p, g, ref_state, dict(
            options, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False))
        ref_p = ref_p.astype(dtype)
        tol = _tolerance(dtype)
        np.testing.assert_allclose(p.array, ref_p, rtol=tol, atol=tol)
        np.testing.assert_allclose(opt.state[p]["momentum_buffer"], ref_state["buf"], rtol=tol)
    torch = pytest.importorskip("torch")
    q = torch.tensor(p0.copy(), requires_grad=True)
    t_opt = torch.optim.SGD([q], **options)
    t_state = t_opt.state_dict()
    t_state["state"] = {0: {"momentum_buffer": torch.tensor(buf)}}
    t_opt.load_state_dict(t_state)
    for k in range(3):
        q.grad = torch.full((3, 4), k + 0.5, dtype=q.dtype)
        t_opt.step()
    np.testing.assert_allclose(p.array, q.detach().numpy(), rtol=5 * tol, atol=5 * tol)
