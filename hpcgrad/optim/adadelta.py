"""Adadelta (with maximize and L2 weight decay): PyTorch's update rule."""

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import (Optimizer, add_scaled, check_lr, check_nonnegative,
                                     refuse_sparse, refuse_unsupported, scalar, update_direction)


class Adadelta(Optimizer):
    """``torch.optim.Adadelta``. Per parameter, with g its gradient (negated if maximize)::

        g = g + weight_decay * p
        square_avg = rho * square_avg + (1 - rho) * g * g
        delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta * delta
        p = p - lr * delta

    State per parameter: ``step`` (int), ``square_avg`` and ``acc_delta``. Sparse gradients are
    refused, as in PyTorch. ``foreach``, ``capturable`` and ``differentiable`` are accepted only
    at values that change nothing here (Note [Accepted at their defaults]).
    """

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *,
                 capturable=False, maximize=False, differentiable=False):
        check_lr(lr)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        check_nonnegative(eps, "epsilon value")
        check_nonnegative(weight_decay, "weight_decay value")
        refuse_unsupported("Adadelta", foreach=foreach, capturable=capturable,
                           differentiable=differentiable)
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = self._closure_loss(closure)
        refuse_sparse(self, "Adadelta")
        self._update_each()
        return loss

    def _update(self, p, group):
        xp = backend.get_array_module(p.array)
        rho, eps = group["rho"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["square_avg"] = xp.zeros_like(p.array)
            state["acc_delta"] = xp.zeros_like(p.array)
        state["step"] += 1
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]

        g, _ = update_direction(p.array, p.grad.array, group["weight_decay"], group["maximize"])
        s = xp.multiply(g, 1 - rho, out=xp.empty_like(square_avg))  # (value * g) * g, as addcmul_
        s *= g
        square_avg *= rho
        square_avg += s
        std = xp.add(square_avg, eps, out=s)
        xp.sqrt(std, out=std)
        delta = xp.add(acc_delta, eps, out=xp.empty_like(acc_delta))
        xp.sqrt(delta, out=delta)
        delta /= std
        delta *= g
        xp.multiply(delta, 1 - rho, out=s)
        s *= delta
        acc_delta *= rho
        acc_delta += s
        add_scaled(p.array, delta, -scalar(group["lr"]), True)
