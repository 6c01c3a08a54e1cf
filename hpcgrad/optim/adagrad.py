"""Adagrad (lr decay, maximize, L2 weight decay, sparse gradients): PyTorch's update rule."""

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import (Optimizer, check_lr, check_nonnegative, refuse_unsupported,
                                     scalar, update_direction)


class Adagrad(Optimizer):
    """``torch.optim.Adagrad``. Per parameter, at step t, with g its gradient (negated if
    maximize)::

        g = g + weight_decay * p
        clr = lr / (1 + (t - 1) * lr_decay)
        sum = sum + g * g
        p = p - clr * g / (sqrt(sum) + eps)

    State per parameter, created with the optimizer as PyTorch does: ``step`` (int) and ``sum``
    (filled with ``initial_accumulator_value``). As in PyTorch, that value is the constructor's
    for every group (a group's own ``initial_accumulator_value`` is stored but not used).

    A sparse gradient (``grad.is_sparse``, e.g. from ``Embedding(sparse=True)``) updates only the
    rows it names, after summing repeated rows; it cannot be combined with weight decay.
    ``foreach``, ``fused`` and ``differentiable`` are accepted only at values that change nothing
    here (Note [Accepted at their defaults]).
    """

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False, fused=None):
        check_lr(lr)
        check_nonnegative(lr_decay, "lr_decay value")
        check_nonnegative(weight_decay, "weight_decay value")
        check_nonnegative(initial_accumulator_value, "initial_accumulator_value value")
        check_nonnegative(eps, "epsilon value")
        refuse_unsupported("Adagrad", foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      maximize=maximize))
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    def _init_state(self, p):
        xp = backend.get_array_module(p.array)
        state = self.state[p]
        state["step"] = 0
        state["sum"] = xp.full_like(p.array, self.defaults["initial_accumulator_value"])
        return state

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:  # before any update, so a refused step changes nothing
            if group["weight_decay"] != 0 and any(getattr(p.grad, "is_sparse", False)
                                                  for p in group["params"]):
                raise RuntimeError("weight_decay option is not compatible with sparse gradients; "
                                   "use weight_decay=0 for the group holding the sparse parameter")
        self._update_each()
        return loss

    def _update(self, p, group):
        state = self.state[p] or self._init_state(p)  # a parameter added after construction
        state["step"] += 1
        clr = scalar(group["lr"]) / (1 + (state["step"] - 1) * group["lr_decay"])
        if getattr(p.grad, "is_sparse", False):
            _sparse_update(p, state["sum"], clr, group["eps"], group["maximize"])
            return
        xp = backend.get_array_module(p.array)
        g, _ = update_direction(p.array, p.grad.array, group["weight_decay"], group["maximize"])
        s = xp.multiply(g, g, out=xp.empty_like(state["sum"]))
        state["sum"] += s
        std = xp.sqrt(state["sum"], out=s)
        std += group["eps"]
        step = xp.multiply(g, -clr, out=xp.empty_like(std))  # (value * g) / std, as addcdiv_
        step /= std
        p.array += step


def _sparse_update(p, state_sum, clr, eps, maximize):
    """The named rows only: repeated rows summed first (the update is not linear in them)."""
    grad = p.grad.coalesce()
    rows, values = grad.indices, grad.values.astype(p.array.dtype, copy=False)
    if maximize:
        values = -values
    xp = backend.get_array_module(p.array)
    state_sum[rows] += values * values  # rows are unique after coalesce: plain indexing adds
    std = xp.sqrt(state_sum[rows])
    std += eps
    step = xp.multiply(values / std, -clr)
    p.array[rows] += step.astype(p.array.dtype, copy=False)

