"""Adadelta (with maximize and L2 weight decay): PyTorch's update rule."""

from .. import backend
from .optimizer import (Optimizer, add_scaled, check_lr, check_nonnegative, scalar,
                        update_direction, written)


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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
                    written(p)
        return loss

    def _update(self, p, group):
        xp = backend.get_array_module(p.data)
        rho, eps = group["rho"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["square_avg"] = xp.zeros_like(p.data)
            state["acc_delta"] = xp.zeros_like(p.data)
        state["step"] += 1
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]

        g, _ = update_direction(p.data, p.grad.data, group["weight_decay"], group["maximize"])
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
        add_scaled(p.data, delta, -scalar(group["lr"]), True)


# Note [Accepted at their defaults]
# PyTorch's Adadelta, RMSprop and Adagrad take implementation switches: foreach (one kernel over
# all parameters), capturable (CUDA graphs), differentiable (autograd through step()) and, for
# Adagrad, fused. hpcgrad updates one parameter at a time with plain array operations, which is
# PyTorch's foreach=False path, so foreach=None/False and fused=None/False are accepted (and not
# stored in the parameter groups), and every other value is refused rather than silently
# ignored: a script that asks for differentiable=True would otherwise get wrong gradients.
_DEFAULTS = {"foreach": (None, False), "fused": (None, False), "capturable": (False,),
             "differentiable": (False,)}


def refuse_unsupported(name, **flags):
    """NotImplementedError for a switch hpcgrad lacks (Note [Accepted at their defaults])."""
    for flag, value in flags.items():
        allowed = _DEFAULTS[flag]
        if not any(value is a or (a is not None and value == a) for a in allowed):
            choices = " or ".join(repr(a) for a in allowed)
            raise NotImplementedError(
                f"{name}({flag}={value!r}) is not supported: hpcgrad implements only PyTorch's "
                f"plain per-parameter update (no foreach/fused kernels, no CUDA-graph capture, "
                f"no autograd through step()); pass {flag}={choices} or leave it out")


def refuse_sparse(optimizer, name):
    """PyTorch's error for a sparse gradient, before any parameter changes."""
    if any(getattr(p.grad, "is_sparse", False)
           for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(f"{name} does not support sparse gradients")
