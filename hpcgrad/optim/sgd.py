"""SGD with momentum, dampening, Nesterov, weight decay and maximize: PyTorch's update rule."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import (Optimizer, add_scaled, check_lr, check_nonnegative,
                                     dense_grad, scalar, update_direction, written)


# The dtypes numba compiles sgd_step for (float16 and longdouble take the numpy path).
_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class SGD(Optimizer):
    """``torch.optim.SGD``. Per parameter, with g its gradient (negated if maximize)::

        g = g + weight_decay * p
        buf = g                                   on the first step (no dampening)
        buf = momentum * buf + (1 - dampening) * g   afterwards
        g = g + momentum * buf if nesterov else buf   (when momentum != 0)
        p = p - lr * g

    A sparse gradient (``grad.is_sparse``) is added to the rows it names with ``add.at`` when
    the group has no momentum and no weight decay; otherwise it is densified first.
    """

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False):
        check_lr(lr)
        check_nonnegative(momentum, "momentum value")
        check_nonnegative(weight_decay, "weight_decay value")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if (getattr(p.grad, "is_sparse", False) and group["momentum"] == 0
                        and group["weight_decay"] == 0):
                    _sparse_step(p, scalar(group["lr"]), group["maximize"])
                else:
                    self._dense_step(p, group)
                written(p)
        return loss

    def _dense_step(self, p, group):
        lr, momentum, dampening = scalar(group["lr"]), group["momentum"], group["dampening"]
        if self._fused_step(p, group):
            return
        d, owned = update_direction(p.array, dense_grad(p), group["weight_decay"], group["maximize"])
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d.copy()
            else:
                buf *= momentum
                # d is still needed after this only for Nesterov (which forbids dampening).
                add_scaled(buf, d, 1 - dampening, owned and not group["nesterov"])
            if group["nesterov"]:
                if owned:
                    add_scaled(d, buf, momentum, False)
                else:
                    xp = backend.get_array_module(buf)
                    d = xp.multiply(buf, momentum, out=xp.empty_like(buf))
                    d += dense_grad(p)
                    owned = True
            else:
                d, owned = buf, False
        add_scaled(p.array, d, -lr, owned)


    def _fused_step(self, p, group):
        """One numba pass instead of three numpy passes, for the common CPU case."""
        grad = p.grad.array if not getattr(p.grad, "is_sparse", False) else None
        if (grad is None or group["weight_decay"] or group["maximize"] or group["nesterov"]
                or type(p.array) is not np.ndarray or type(grad) is not np.ndarray
                or p.array.dtype != grad.dtype or p.array.dtype not in _FUSED_DTYPES
                or not (p.array.flags.c_contiguous and grad.flags.c_contiguous)):
            return False
        buf = None
        if group["momentum"] != 0:
            buf = self.state[p].get("momentum_buffer")
            if buf is None:
                return False  # the first step copies the gradient: the numpy path does it
            if not (type(buf) is np.ndarray and buf.dtype == p.array.dtype
                    and buf.flags.c_contiguous):
                return False  # e.g. loaded in Fortran order: reshape(-1) would write a copy
        from hpcgrad.base.kernels.cpu import sgd_step
        sgd_step(p.array, grad, buf, scalar(group["lr"]), group["momentum"], group["dampening"])
        return True


def _sparse_step(p, lr, maximize):
    """``p[rows] -= lr * values`` with repeated rows accumulated (add.at), as for a dense add."""
    indices, values = p.grad.indices, p.grad.values
    # 1-D: row indices; 2-D: one row of coordinates per sparse dimension (torch's COO layout)
    where = indices if indices.ndim == 1 else tuple(indices)
    xp = backend.get_array_module(p.array)
    step = xp.multiply(values, lr if maximize else -lr).astype(p.array.dtype, copy=False)
    if xp is np:
        np.add.at(p.array, where, step)
    else:
        import cupyx
        cupyx.scatter_add(p.array, where, step)
