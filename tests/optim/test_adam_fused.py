"""Adam's and AdamW's fused numba step (kernels/cpu.py adam_step) is reached and gives the numpy
path's bits, with every option it takes (L2 or decoupled decay, amsgrad, maximize); the
programs of test_issue25_optim.py also compare both paths with the formula and PyTorch."""

import numpy as np
import pytest

import hpcgrad
import hpcgrad.base.kernels.cpu as cpu
from hpcgrad.optim import Adam, AdamW


def _run(cls, options, dtype, fused):
    rng = np.random.default_rng(3)
    params = [hpcgrad.tensor(rng.standard_normal(s).astype(dtype), requires_grad=True)
              for s in ((3, 4), (5,), ())]
    opt = cls(params, **options)
    if not fused:
        opt._fused_step = lambda p, group: False
    for _ in range(4):
        for p in params:
            p.grad = hpcgrad.tensor(rng.standard_normal(p.shape).astype(dtype))
        opt.step()
    return [p.array.copy() for p in params] + [
        s[k].copy() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls, options", [
    (Adam, {"lr": 0.01}),
    (Adam, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    (Adam, {"lr": 0.01, "maximize": True, "betas": (0.8, 0.95)}),
    (AdamW, {"lr": 0.01}),
    (AdamW, {"lr": 0.05, "weight_decay": 0.2, "amsgrad": True, "maximize": True}),
])
def test_the_fused_step_is_reached_and_bit_equal(cls, options, dtype, monkeypatch):
    calls = []
    kernel = cpu.adam_step
    monkeypatch.setattr(cpu, "adam_step", lambda *args: calls.append(1) or kernel(*args))
    fused = _run(cls, options, dtype, True)
    assert len(calls) == 12  # 3 parameters, 4 steps
    plain = _run(cls, options, dtype, False)
    for a, b in zip(fused, plain):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(a, b)


def test_float16_and_fortran_order_state_take_the_numpy_path(monkeypatch):
    p = hpcgrad.tensor(np.ones((3, 4), np.float16), requires_grad=True)
    p.grad = hpcgrad.tensor(np.ones((3, 4), np.float16))
    q = hpcgrad.tensor(np.ones((3, 4), np.float32), requires_grad=True)
    q.grad = hpcgrad.tensor(np.ones((3, 4), np.float32))
    opt = Adam([q], lr=0.1)
    opt.step()  # float32, C order: fused
    state = opt.state[q]
    state["exp_avg"] = np.asfortranarray(state["exp_avg"])  # as a loaded checkpoint may be
    want = _numpy_path_copy(opt, q)
    monkeypatch.setattr(cpu, "adam_step", lambda *args: pytest.fail("fused"))
    AdamW([p], lr=0.1).step()
    assert p.array.dtype == np.float16 and np.all(p.array < 1)
    opt.step()
    np.testing.assert_array_equal(q.array, want)


def _numpy_path_copy(opt, q):
    """What the numpy path makes of one more step of ``opt`` on ``q``, on copies."""
    twin = hpcgrad.tensor(q.array.copy(), requires_grad=True)
    twin.grad = hpcgrad.tensor(q.grad.array.copy())
    other = Adam([twin], lr=0.1)
    other.state[twin] = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                         for k, v in opt.state[q].items()}
    other._fused_step = lambda p, group: False
    other.step()
    return twin.array
