"""Adam (with amsgrad, maximize and L2 weight decay): PyTorch's update rule, bias-corrected."""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import Optimizer, check_lr, check_nonnegative, scalar, update_direction


# The dtypes numba compiles adam_step for (float16 and longdouble take the numpy path).
_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Adam(Optimizer):
    """``torch.optim.Adam``. Per parameter, at step t, with g its gradient (negated if maximize)::

        g = g + weight_decay * p          (AdamW instead: p = p * (1 - lr * weight_decay))
        m = m + (1 - beta1) * (g - m)     (lerp, as PyTorch computes it)
        v = beta2 * v + (1 - beta2) * g * g
        vmax = max(vmax, v)               (amsgrad; then vmax replaces v below)
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
    ``max_exp_avg_sq``. Sparse gradients are refused, as in PyTorch.
    """

    _decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False):
        check_lr(lr)
        check_nonnegative(eps, "epsilon value")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        check_nonnegative(weight_decay, "weight_decay value")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = self._closure_loss(closure)
        if any(getattr(p.grad, "is_sparse", False) for g in self.param_groups for p in g["params"]):
            # before any update, so a refused step changes nothing
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, please "
                               "consider SparseAdam instead")
        self._update_each()
        return loss

    def _update(self, p, group):
        xp = backend.get_array_module(p.array)
        lr, (beta1, beta2), eps = scalar(group["lr"]), group["betas"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = xp.zeros_like(p.array)
            state["exp_avg_sq"] = xp.zeros_like(p.array)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = xp.zeros_like(p.array)
        state["step"] += 1
        step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]

        if self._fused_step(p, group):
            return
        wd = group["weight_decay"]
        if self._decoupled_weight_decay and wd != 0:
            p.array *= 1 - lr * wd
        g, _ = update_direction(p.array, p.grad.array, 0 if self._decoupled_weight_decay else wd,
                                group["maximize"])
        s = xp.subtract(g, m, out=xp.empty_like(m))  # the one scratch array of this update
        s *= 1 - beta1
        m += s
        v *= beta2
        xp.multiply(g, g, out=s)
        s *= 1 - beta2
        v += s
        if group["amsgrad"]:
            vmax = state.get("max_exp_avg_sq")
            if vmax is None:  # amsgrad switched on after the first steps
                vmax = state["max_exp_avg_sq"] = v.copy()
            xp.maximum(vmax, v, out=vmax)
            v = vmax
        step_size = lr / (1 - beta1 ** step)
        xp.sqrt(v, out=s)
        s /= math.sqrt(1 - beta2 ** step)
        s += eps
        xp.divide(m, s, out=s)
        s *= -step_size
        p.array += s

    def _fused_step(self, p, group):
        """One numba pass (kernels/cpu.py adam_step) for the numpy path's ten, the same
        operations in the same order, for C-contiguous numpy float32/float64 arrays; False
        (nothing done) otherwise. Called after the step count has moved."""
        state = self.state[p]
        m, v, vmax = state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")
        arrays = (p.array, p.grad.array, m, v) + ((vmax,) if group["amsgrad"] else ())
        if group["amsgrad"] and vmax is None:
            return False  # (amsgrad switched on after the first steps: numpy's first copy)
        if backend.is_gpu_array(p.array):  # kernels/cuda_pointwise.py, where switched on
            from hpcgrad.base.kernels import cuda_pointwise
            if not cuda_pointwise.adam_typed(*arrays):
                return False
            adam_step = cuda_pointwise.adam_step
        elif p.array.dtype not in _FUSED_DTYPES or not all(
                type(a) is np.ndarray and a.dtype == p.array.dtype and a.flags.c_contiguous
                for a in arrays):
            return False
        else:
            from hpcgrad.base.kernels.cpu import adam_step
        lr, (beta1, beta2), wd = scalar(group["lr"]), group["betas"], group["weight_decay"]
        decay = 1 - lr * wd if self._decoupled_weight_decay and wd != 0 else 1
        g, _ = update_direction(p.array, p.grad.array, 0 if self._decoupled_weight_decay else wd,
                                group["maximize"])
        step = state["step"]
        adam_step(p.array, g, m, v, vmax if group["amsgrad"] else None, decay, (beta1, beta2),
                  math.sqrt(1 - beta2 ** step), group["eps"], lr / (1 - beta1 ** step))
        return True
