"""AdamW: Adam with decoupled weight decay (p *= 1 - lr * weight_decay before the Adam step)."""

from hpcgrad.optim.adam import Adam


class AdamW(Adam):
    """``torch.optim.AdamW``: as Adam, but the decay shrinks the parameters directly instead of
    entering the gradient (and so the moment estimates). Default weight_decay is 1e-2."""

    _decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
