"""Learning-rate schedulers: lr (and momentum) sequences beside torch's schedulers step by step,
hand-computed values, state_dict round trips, the step-order warning and the errors."""

import json
import math
import warnings

import numpy as np
import pytest

import hpcgrad
from hpcgrad.optim import SGD, Adam, lr_scheduler

STEPS = 25


def _hg_optimizer(kind, lrs=(0.1, 0.02)):
    """Two param groups with different lrs (a scheduler must treat each on its own)."""
    params = [hpcgrad.tensor(np.ones(2), requires_grad=True) for _ in lrs]
    groups = [{"params": [p], "lr": lr} for p, lr in zip(params, lrs)]
    if kind == "sgd":
        return SGD(groups, lr=lrs[0], momentum=0.9)
    return Adam(groups, lr=lrs[0], betas=(0.9, 0.999))


def _torch_optimizer(torch, kind, lrs=(0.1, 0.02)):
    params = [torch.ones(2, dtype=torch.float64, requires_grad=True) for _ in lrs]
    groups = [{"params": [p], "lr": lr} for p, lr in zip(params, lrs)]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=lrs[0], betas=(0.9, 0.999))


def _momenta(opt):
    return [g["betas"][0] if "betas" in g else g.get("momentum") for g in opt.param_groups]


def _sequence(opt, scheduler, steps=STEPS):
    """lrs (and momenta) after construction and after each optimizer.step(); scheduler.step()."""
    seq = [(list(scheduler.get_last_lr()), _momenta(opt))]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        seq.append((list(scheduler.get_last_lr()), _momenta(opt)))
    return seq


def _sequential(m, opt):
    return m.SequentialLR(opt, [m.LinearLR(opt, start_factor=0.1, total_iters=4),
                                m.CosineAnnealingLR(opt, T_max=10, eta_min=0.001)],
                          milestones=[5])


SCHEDULERS = {
    "step": lambda m, opt: m.StepLR(opt, step_size=4, gamma=0.5),
    "multistep": lambda m, opt: m.MultiStepLR(opt, milestones=[3, 7, 7, 12], gamma=0.3),
    "exponential": lambda m, opt: m.ExponentialLR(opt, gamma=0.9),
    "cosine": lambda m, opt: m.CosineAnnealingLR(opt, T_max=8, eta_min=0.001),
    "linear": lambda m, opt: m.LinearLR(opt, start_factor=0.25, total_iters=6),
    "linear_decay": lambda m, opt: m.LinearLR(opt, start_factor=1.0, end_factor=0.1,
                                              total_iters=10),
    "lambda": lambda m, opt: m.LambdaLR(opt, [lambda e: 0.95 ** e, lambda e: 1 / (e + 1)]),
    "sequential": _sequential,
    "constant": lambda m, opt: m.ConstantLR(opt, factor=0.4, total_iters=3),
    "warm_restarts": lambda m, opt: m.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2,
                                                                 eta_min=0.001),
    "warm_restarts_1": lambda m, opt: m.CosineAnnealingWarmRestarts(opt, T_0=4),
    "chained": lambda m, opt: m.ChainedScheduler([m.ExponentialLR(opt, gamma=0.9),
                                                  m.StepLR(opt, step_size=3, gamma=0.5)]),
    "polynomial": lambda m, opt: m.PolynomialLR(opt, total_iters=12, power=2.0),
    "multiplicative": lambda m, opt: m.MultiplicativeLR(opt, lambda e: 0.9 if e % 2 else 1.05),
    "onecycle_cos": lambda m, opt: m.OneCycleLR(opt, max_lr=[1.0, 0.5], total_steps=STEPS),
    "onecycle_linear": lambda m, opt: m.OneCycleLR(opt, max_lr=0.3, epochs=5, steps_per_epoch=5,
                                                   anneal_strategy="linear", pct_start=0.4),
    "onecycle_three": lambda m, opt: m.OneCycleLR(opt, max_lr=0.3, total_steps=STEPS,
                                                  three_phase=True, base_momentum=0.8),
}


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_sequence_equals_torch(name, kind):
    torch = pytest.importorskip("torch")
    make = SCHEDULERS[name]
    got = _sequence(opt := _hg_optimizer(kind), make(lr_scheduler, opt))
    want = _sequence(topt := _torch_optimizer(torch, kind), make(torch.optim.lr_scheduler, topt))
    for step, ((lrs, moms), (want_lrs, want_moms)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(lrs, want_lrs, rtol=1e-13, atol=0, err_msg=f"step {step}")
        np.testing.assert_allclose(moms, want_moms, rtol=1e-13, atol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("name", ["step", "multistep", "exponential", "cosine", "linear",
                                  "constant", "polynomial", "warm_restarts", "warm_restarts_1"])
def test_deprecated_epoch_argument_uses_the_closed_form_as_torch(name):
    torch = pytest.importorskip("torch")
    make = SCHEDULERS[name]
    sched = make(lr_scheduler, opt := _hg_optimizer("sgd"))
    tsched = make(torch.optim.lr_scheduler, topt := _torch_optimizer(torch, "sgd"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in (3, 9, 4, 20):
            opt.step(), topt.step()
            sched.step(epoch)
            tsched.step(epoch)
            np.testing.assert_allclose(sched.get_last_lr(), tsched.get_last_lr(), rtol=1e-13)


# --- by hand (no torch needed) ---------------------------------------------------------------
def _lrs(scheduler, opt, steps):
    out = [scheduler.get_last_lr()[0]]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


def test_step_multistep_exponential_by_hand():
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    assert _lrs(lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), opt, 5) == pytest.approx(
        [1, 1, 0.5, 0.5, 0.25, 0.25])
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    assert _lrs(lr_scheduler.MultiStepLR(opt, [1, 3, 3], gamma=0.1), opt, 4) == pytest.approx(
        [1, 0.1, 0.1, 0.001, 0.001])
    opt = _hg_optimizer("sgd", lrs=(2.0,))
    assert _lrs(lr_scheduler.ExponentialLR(opt, gamma=0.5), opt, 3) == pytest.approx(
        [2, 1, 0.5, 0.25])


def test_cosine_and_linear_by_hand():
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    got = _lrs(lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.2), opt, 8)
    want = [0.2 + 0.8 * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(9)]
    assert got == pytest.approx(want, abs=1e-12)  # down to eta_min at T_max, then back up
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    got = _lrs(lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=4), opt, 6)
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])


def test_onecycle_by_hand_with_sgd_momentum():
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    sched = lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=11, pct_start=0.5,
                                    anneal_strategy="linear", div_factor=10.0,
                                    final_div_factor=100.0)
    lrs = [sched.get_last_lr()[0]]
    moms = [opt.param_groups[0]["momentum"]]
    for _ in range(10):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
        moms.append(opt.param_groups[0]["momentum"])
    # up from 0.1 to 1.0 over steps 0..4.5, then down to 0.1/100 at step 10
    up = [0.1 + 0.9 * s / 4.5 for s in range(5)]
    down = [1.0 + (0.001 - 1.0) * (s - 4.5) / 5.5 for s in range(5, 11)]
    assert lrs == pytest.approx(up + down, abs=1e-12)
    # momentum the other way: 0.95 down to 0.85 at step 4.5, back up to 0.95
    want = ([0.95 - 0.1 * s / 4.5 for s in range(5)]
            + [0.85 + 0.1 * (s - 4.5) / 5.5 for s in range(5, 11)])
    assert moms == pytest.approx(want, abs=1e-12)
    opt.step()
    sched.step()  # step 11 of total_steps=11 is allowed, as in PyTorch; step 12 is not
    with pytest.raises(ValueError, match="Tried to step 12 times"):
        sched.step()


def test_onecycle_cycles_adam_beta1():
    opt = _hg_optimizer("adam", lrs=(1.0,))
    lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10, base_momentum=0.7,
                            max_momentum=0.9)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 / 25)


def test_the_optimizer_uses_the_scheduled_lr():
    p = hpcgrad.tensor(np.zeros(1), requires_grad=True)
    opt = SGD([p], lr=1.0)
    sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = hpcgrad.tensor(np.ones(1))
        opt.step()
        sched.step()
    np.testing.assert_allclose(p.array, [-(1 + 0.5 + 0.25)])


# --- state_dict ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["step", "multistep", "cosine", "linear", "onecycle_cos",
                                  "sequential"])
def test_state_dict_round_trip_resumes_the_sequence(name):
    make = SCHEDULERS[name]
    opt = _hg_optimizer("sgd")
    sched = make(lr_scheduler, opt)
    full = _sequence(opt, sched, steps=12)
    opt = _hg_optimizer("sgd")
    sched = make(lr_scheduler, opt)
    _sequence(opt, sched, steps=5)
    saved_sched, saved_opt = sched.state_dict(), opt.state_dict()
    assert "optimizer" not in saved_sched
    opt2 = _hg_optimizer("sgd")
    sched2 = make(lr_scheduler, opt2)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert sched2.last_epoch == 5 and sched2.get_last_lr() == full[5][0]
    rest = _sequence(opt2, sched2, steps=7)
    for (lrs, moms), (want_lrs, want_moms) in zip(rest, full[5:]):
        assert lrs == pytest.approx(want_lrs, rel=1e-13)
        assert moms == pytest.approx(want_moms, rel=1e-13)


@pytest.mark.parametrize("name", sorted(set(SCHEDULERS) - {"lambda", "multiplicative"}))
def test_state_dict_survives_json(name):
    """hpcgrad.training.checkpoint keeps extra state as JSON: keys become strings, tuples lists."""
    make = SCHEDULERS[name]
    opt = _hg_optimizer("sgd")
    sched = make(lr_scheduler, opt)
    full = _sequence(opt, sched, steps=10)
    opt = _hg_optimizer("sgd")
    sched = make(lr_scheduler, opt)
    _sequence(opt, sched, steps=4)
    saved = json.loads(json.dumps(sched.state_dict()))
    opt2 = _hg_optimizer("sgd")
    sched2 = make(lr_scheduler, opt2)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(saved)
    for (lrs, _), (want, _) in zip(_sequence(opt2, sched2, steps=6), full[4:]):
        assert lrs == pytest.approx(want, rel=1e-13)


def test_lambda_state_dict_keeps_callable_objects_not_functions():
    class Factor:
        def __init__(self):
            self.scale = 0.5

        def __call__(self, epoch):
            return self.scale ** epoch

    opt = _hg_optimizer("sgd", lrs=(1.0,))
    sched = lr_scheduler.LambdaLR(opt, Factor())
    sched.lr_lambdas[0].scale = 0.25
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"scale": 0.25}]
    opt2 = _hg_optimizer("sgd", lrs=(1.0,))
    sched2 = lr_scheduler.LambdaLR(opt2, Factor())
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr() == [0.25]
    opt3 = _hg_optimizer("sgd", lrs=(1.0,))
    assert lr_scheduler.LambdaLR(opt3, lambda e: 1.0).state_dict()["lr_lambdas"] == [None]


def test_resume_with_last_epoch():
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched = lr_scheduler.StepLR(opt, step_size=2, gamma=0.5, last_epoch=3)
    assert sched.last_epoch == 4 and sched.base_lrs == [1.0]
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    with pytest.raises(KeyError, match="initial_lr"):
        lr_scheduler.StepLR(opt, step_size=2, last_epoch=3)


# --- warnings and errors ---------------------------------------------------------------------
def test_warns_when_scheduler_steps_before_optimizer():
    opt = _hg_optimizer("sgd")
    sched = lr_scheduler.StepLR(opt, step_size=2)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()
    opt = _hg_optimizer("sgd")
    sched = lr_scheduler.StepLR(opt, step_size=2)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
        sched.get_last_lr()
    with pytest.warns(UserWarning, match="get_last_lr"):
        sched.get_lr()


def test_warns_when_optimizer_step_is_replaced_after_construction():
    opt = _hg_optimizer("sgd")
    sched = lr_scheduler.ExponentialLR(opt, gamma=0.5)
    opt.step = lambda closure=None: None
    with pytest.warns(UserWarning, match="overridden"):
        sched.step()


def test_errors():
    opt = _hg_optimizer("sgd")
    with pytest.raises(TypeError, match="is not an Optimizer"):
        lr_scheduler.StepLR(object(), step_size=1)
    with pytest.raises(ValueError, match="step_size"):
        lr_scheduler.StepLR(opt, step_size=0)
    with pytest.raises(ValueError, match="Starting multiplicative factor"):
        lr_scheduler.LinearLR(opt, start_factor=0)
    with pytest.raises(ValueError, match="Ending multiplicative factor"):
        lr_scheduler.LinearLR(opt, end_factor=1.5)
    with pytest.raises(ValueError, match="Expected 2 lr_lambdas, but got 1"):
        lr_scheduler.LambdaLR(opt, [lambda e: 1.0])
    with pytest.raises(ValueError, match="T_max"):
        lr_scheduler.CosineAnnealingLR(opt, T_max=0)
    with pytest.raises(ValueError, match="either total_steps OR"):
        lr_scheduler.OneCycleLR(opt, max_lr=1.0)
    with pytest.raises(ValueError, match="positive integer total_steps"):
        lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=0)
    with pytest.raises(ValueError, match="pct_start"):
        lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5, pct_start=2.0)
    with pytest.raises(ValueError, match="anneal_strategy"):
        lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5, anneal_strategy="step")
    with pytest.raises(ValueError, match="max_lr must have the same length"):
        lr_scheduler.OneCycleLR(opt, max_lr=[1.0], total_steps=5)
    with pytest.raises(ValueError, match="number of milestones"):
        lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(opt, 2)], milestones=[3])
    other = _hg_optimizer("sgd")
    with pytest.raises(ValueError, match="same optimizer"):
        lr_scheduler.SequentialLR(opt, [lr_scheduler.StepLR(other, 2)], milestones=[])


# --- ReduceLROnPlateau -----------------------------------------------------------------------
PLATEAU_METRICS = [5.0, 4.0, 4.0, 3.9999, 4.1, 4.2, 3.0, 3.0, 3.0, 3.0, 3.0, 2.0, 2.5, 2.6, 2.7,
                   2.8, 2.9, 3.0, 3.1, 3.2]


@pytest.mark.parametrize("kwargs", [
    {},
    {"patience": 2},
    {"patience": 1, "cooldown": 2, "factor": 0.5, "min_lr": [0.01, 0.005]},
    {"mode": "max", "patience": 0, "threshold_mode": "abs", "threshold": 0.05},
    {"patience": 1, "threshold": 0.1, "eps": 0.05},
], ids=str)
def test_plateau_equals_torch(kwargs):
    torch = pytest.importorskip("torch")
    opt, topt = _hg_optimizer("sgd"), _torch_optimizer(torch, "sgd")
    sched = lr_scheduler.ReduceLROnPlateau(opt, **kwargs)
    tsched = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kwargs)
    for metric in PLATEAU_METRICS:
        opt.step(), topt.step()
        sched.step(metric)
        tsched.step(metric)
        assert sched.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=1e-13)
        assert sched.num_bad_epochs == tsched.num_bad_epochs


def test_plateau_by_hand_and_state_dict():
    opt = _hg_optimizer("sgd", lrs=(1.0,))
    sched = lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    lrs = []
    for metric in [3.0, 3.0, 3.0, 2.0, 2.0, 2.0]:
        sched.step(metric)
        lrs.append(sched.get_last_lr()[0])
    # bad epochs: 0, 1, 2 (> patience: halve, reset), better, 1, 2 (halve)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    saved = json.loads(json.dumps(sched.state_dict()))
    opt2 = _hg_optimizer("sgd", lrs=(0.25,))
    sched2 = lr_scheduler.ReduceLROnPlateau(opt2, patience=1, factor=0.5)
    sched2.load_state_dict(saved)
    assert sched2.best == 2.0 and sched2.last_epoch == 6
    with pytest.raises(ValueError, match="Factor should be < 1.0"):
        lr_scheduler.ReduceLROnPlateau(opt, factor=1.0)
    with pytest.raises(ValueError, match="mode avg is unknown"):
        lr_scheduler.ReduceLROnPlateau(opt, mode="avg")
    with pytest.raises(ValueError, match="expected 1 min_lrs, got 2"):
        lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0, 0])
