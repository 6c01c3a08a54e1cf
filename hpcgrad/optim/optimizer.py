"""Optimizer: parameter groups with per-group options, per-parameter state, zero_grad and state_dict.

Follows ``torch.optim.Optimizer``: ``param_groups`` is a list of dicts (``"params"`` plus options),
``state`` maps a parameter to a dict of its buffers, and ``state_dict()`` uses PyTorch's layout::

    {"state": {param_index: {"momentum_buffer": array, ...}},
     "param_groups": [{"lr": 0.1, ..., "params": [param_index, ...]}]}

State buffers are arrays (numpy or cupy, like the parameters), scalars stay Python numbers.
Updates happen in place on ``p.array`` (the array): other code (a DDP reducer, a model) holds those arrays.
Each step counts as one in-place write of every parameter it changes (``written``), as PyTorch's
``p.add_(...)`` does: a graph built before ``step()`` and differentiated after it then raises
"modified by an inplace operation" instead of silently using the new weights.
"""

import copy
from collections import defaultdict

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import enable_grad, version_counter
from hpcgrad.tensor._tensor import Tensor


class _RequiredParameter:
    """Marks an option every parameter group must give (no default)."""

    def __repr__(self):
        return "<required parameter>"


required = _RequiredParameter()


class Optimizer:
    """Base class: subclasses pass their option defaults and implement ``step``."""

    def __init__(self, params, defaults):
        self.defaults = defaults
        self.state = defaultdict(dict)  # keyed by the parameter Tensor (hashed by identity)
        self.param_groups = []
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(params).__name__}")
        param_groups = list(params)
        if len(param_groups) == 0:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        for group in param_groups:
            self.add_param_group(group)

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {key}: {group[key]}" for key in sorted(group) if key != "params"]
        return "\n".join(lines) + "\n)"

    def add_param_group(self, param_group):
        """Add a group of parameters with its own options (missing ones come from the defaults)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use "
                            "a list instead.")
        else:
            params = list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is "
                                f"{type(p).__name__}")
            if p.grad_fn is not None:
                raise ValueError("can't optimize a non-leaf Tensor")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("optimizer contains a parameter group with duplicate parameters; "
                             "list each parameter once")
        group = dict(param_group, params=params)
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required "
                                 f"optimization parameter {name}")
            group.setdefault(name, default)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params):  # ids: Tensor == compares element-wise
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none=True):
        """Reset every parameter's gradient: to None (default), or to zeros in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif getattr(p.grad, "is_sparse", False):
                    p.grad = None  # a sparse zero has no entries; None means the same to step()
                else:
                    if p.grad.grad_fn is not None:
                        p.grad = p.grad.detach()
                    p.grad.requires_grad = False
                    p.grad.array[...] = 0
                    written(p.grad)  # PyTorch's grad.zero_() counts as a write

    def step(self, closure=None):
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with enable_grad():
            return closure()

    def _update_each(self):
        """``self._update(p, group)`` for every parameter with a gradient, in group order,
        each counted as an in-place write of ``p`` (``written``)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
                    written(p)

    # --- state_dict ----------------------------------------------------------------------
    def state_dict(self):
        """PyTorch's layout: parameters become indices, numbered in group order.

        Arrays are returned by reference (as PyTorch does); ``load_state_dict`` copies them.
        """
        index_of = {}
        groups = []
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            for p in group["params"]:
                index_of.setdefault(id(p), len(index_of))
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {index_of[id(p)]: value for p, value in self.state.items() if id(p) in index_of}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore options and state saved by ``state_dict()`` from an optimizer over the same
        parameter layout (same number of groups, same group sizes, same shapes)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"expected a dict with keys 'state' and 'param_groups' (from "
                             f"Optimizer.state_dict()), got {keys}")
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups: "
                             f"{len(saved_groups)} saved, {len(groups)} in this optimizer")
        for i, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't match "
                                 f"the size of optimizer's group: group {i} has "
                                 f"{len(saved['params'])} parameters saved, {len(group['params'])} "
                                 f"here")
        params_by_index = {index: p for group, saved in zip(groups, saved_groups)
                           for index, p in zip(saved["params"], group["params"])}
        new_state = defaultdict(dict)
        for key, value in state_dict["state"].items():
            index = int(key)  # JSON round trips turn keys into strings
            if index not in params_by_index:
                raise ValueError(f"loaded state dict has state for parameter {index}, which no "
                                 f"parameter group lists")
            p = params_by_index[index]
            new_state[p] = {name: _state_value(p, index, name, item)
                            for name, item in value.items()}
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            restored = {key: _like(group.get(key), copy.deepcopy(value))
                        for key, value in saved.items() if key != "params"}
            new_groups.append({**restored, "params": group["params"]})
        self.state, self.param_groups = new_state, new_groups


def _like(current, value):
    """A JSON list back to the tuple the option was (e.g. Adam's betas)."""
    return tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value


def _state_value(p, index, name, value):
    """A private copy of a saved state entry, as an array on p's device (floats in p's dtype)."""
    if isinstance(value, Tensor):
        value = value.array
    if not (isinstance(value, np.ndarray) or backend.is_gpu_array(value)):
        return value.item() if isinstance(value, np.generic) else copy.deepcopy(value)
    if value.shape != p.array.shape:
        raise ValueError(f"loaded state dict has {name!r} of shape {tuple(value.shape)} for "
                         f"parameter {index}, but that parameter has shape {tuple(p.array.shape)}; "
                         f"was it saved from a different model?")
    value = backend.to_device(value, p.device)
    dtype = p.array.dtype if value.dtype.kind == "f" and p.array.dtype.kind == "f" else value.dtype
    return value.astype(dtype, copy=True)


def written(p):
    """Count one in-place write of ``p``'s memory (seen through its views and saved tensors)."""
    version_counter.bump(p.array)


def update_direction(p, grad, weight_decay, maximize):
    """The gradient as SGD and Adam use it: ``-grad`` if maximize, plus ``weight_decay * p``.

    Returns (d, owned): ``owned`` says whether d is a new array the caller may overwrite; when
    no change is needed d is the caller's gradient itself, which must stay untouched.
    """
    xp = backend.get_array_module(p)
    if weight_decay != 0:
        d = xp.multiply(p, weight_decay, out=xp.empty_like(p))  # out=: 0-d stays an array
        (xp.subtract if maximize else xp.add)(d, grad, out=d)  # wd*p - g == -g + wd*p exactly
        return d, True
    if maximize:
        return xp.negative(grad, out=xp.empty_like(p)), True
    return grad, False


def add_scaled(y, x, alpha, x_owned):
    """``y += alpha * x`` in place; x is used as the scratch for ``alpha * x`` when owned."""
    if alpha == 1:
        y += x
        return
    xp = backend.get_array_module(y)
    y += xp.multiply(x, alpha, out=x if x_owned else None)


def dense_grad(p):
    """p's gradient as an array (a sparse gradient densified)."""
    grad = p.grad
    if getattr(grad, "is_sparse", False):
        grad = grad.to_dense()
    return grad.array if isinstance(grad, Tensor) else grad


def check_lr(lr):
    """A float, or a 1-element Tensor (PyTorch's Tensor lr, which schedulers write in place)."""
    if isinstance(lr, Tensor) and lr.array.size != 1:
        raise ValueError(f"Tensor lr must be 1-element, got a Tensor of shape {list(lr.shape)}")
    check_nonnegative(float(lr), "learning rate")


def scalar(value):
    """A hyper-parameter as a number: a Tensor lr is read at each step (it may change)."""
    return float(value) if isinstance(value, Tensor) else value


def check_nonnegative(value, what):
    if not 0.0 <= value:
        raise ValueError(f"Invalid {what}: {value}")


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
