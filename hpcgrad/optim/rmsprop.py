"""RMSprop (with momentum, centering, maximize and L2 weight decay): PyTorch's update rule."""

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import (Optimizer, add_scaled, check_lr, check_nonnegative,
                                     refuse_sparse, refuse_unsupported, scalar, update_direction)


class RMSprop(Optimizer):
    """``torch.optim.RMSprop``. Per parameter, with g its gradient (negated if maximize)::

        g = g + weight_decay * p
        square_avg = alpha * square_avg + (1 - alpha) * g * g
        avg = sqrt(square_avg) + eps
        grad_avg = grad_avg + (1 - alpha) * (g - grad_avg)          (centered: lerp, as PyTorch)
        avg = sqrt(square_avg - grad_avg * grad_avg) + eps           (centered)
        buf = momentum * buf + g / avg;  p = p - lr * buf            (momentum > 0)
        p = p - lr * g / avg                                         (otherwise)

    State per parameter: ``step`` (int), ``square_avg``, ``momentum_buffer`` (momentum > 0) and
    ``grad_avg`` (centered). Sparse gradients are refused, as in PyTorch. ``foreach``,
    ``capturable`` and ``differentiable`` are accepted only at values that change nothing here
    (Note [Accepted at their defaults]).
    """

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False):
        check_lr(lr)
        check_nonnegative(eps, "epsilon value")
        check_nonnegative(momentum, "momentum value")
        check_nonnegative(weight_decay, "weight_decay value")
        check_nonnegative(alpha, "alpha value")
        refuse_unsupported("RMSprop", foreach=foreach, capturable=capturable,
                           differentiable=differentiable)
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps,
                                      centered=centered, weight_decay=weight_decay,
                                      maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure() if given."""
        loss = self._closure_loss(closure)
        refuse_sparse(self, "RMSprop")
        self._update_each()
        return loss

    def _update(self, p, group):
        xp = backend.get_array_module(p.array)
        alpha, eps, momentum = group["alpha"], group["eps"], group["momentum"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["square_avg"] = xp.zeros_like(p.array)
            if momentum > 0:
                state["momentum_buffer"] = xp.zeros_like(p.array)
            if group["centered"]:
                state["grad_avg"] = xp.zeros_like(p.array)
        state["step"] += 1
        square_avg = state["square_avg"]

        g, _ = update_direction(p.array, p.grad.array, group["weight_decay"], group["maximize"])
        # (value * g) * g, as addcmul_
        avg = xp.multiply(g, 1 - alpha, out=xp.empty_like(square_avg))
        avg *= g
        square_avg *= alpha
        square_avg += avg
        if group["centered"]:
            grad_avg = state.get("grad_avg")
            if grad_avg is None:  # centered switched on after the first steps (PyTorch fails)
                grad_avg = state["grad_avg"] = xp.zeros_like(p.array)
            _lerp_(grad_avg, g, 1 - alpha, scratch=avg)
            xp.multiply(grad_avg, grad_avg, out=avg)
            xp.subtract(square_avg, avg, out=avg)
            xp.sqrt(avg, out=avg)
        else:
            xp.sqrt(square_avg, out=avg)
        avg += eps
        lr = scalar(group["lr"])
        if momentum > 0:
            buf = state.get("momentum_buffer")
            if buf is None:  # momentum switched on after the first steps (PyTorch fails)
                buf = state["momentum_buffer"] = xp.zeros_like(p.array)
            buf *= momentum
            xp.divide(g, avg, out=avg)
            buf += avg
            add_scaled(p.array, buf, -lr, False)
        else:
            step = xp.multiply(g, -lr, out=xp.empty_like(avg))  # (value * g) / avg, as addcdiv_
            step /= avg
            p.array += step


def _lerp_(start, end, weight, scratch):
    """``start += weight * (end - start)`` in place with PyTorch's two-sided formula (exact at
    weight 1): ``end - (end - start) * (1 - weight)`` when weight >= 0.5."""
    xp = backend.get_array_module(start)
    xp.subtract(end, start, out=scratch)
    if abs(weight) < 0.5:
        scratch *= weight
        start += scratch
    else:
        scratch *= 1 - weight
        xp.subtract(end, scratch, out=start)
