"""Finite-difference checks of first and second derivatives (use float64 inputs)."""

import numpy as np


class GradcheckError(RuntimeError):
    """Analytical and numerical derivatives disagree."""


def _as_tuple(x):
    return x if isinstance(x, tuple) else tuple(x) if isinstance(x, list) else (x,)


def _numerical_jacobian(fn, inputs, i, out_index, out_size, eps):
    """d out[out_index] / d inputs[i], column by column, by central differences."""
    x = inputs[i].data
    columns = []
    # Not under no_grad: fn may itself differentiate (gradgradcheck's first derivative).
    # Index x itself (C order, as the analytical rows): reshape(-1) of a non-contiguous input
    # would be a copy, and the perturbation would never reach fn.
    for k in np.ndindex(x.shape):
        orig = x[k]
        x[k] = orig + eps
        plus = _as_tuple(fn(*inputs))[out_index].data.astype(np.float64).reshape(-1)
        x[k] = orig - eps
        minus = _as_tuple(fn(*inputs))[out_index].data.astype(np.float64).reshape(-1)
        x[k] = orig
        columns.append((plus - minus) / (2 * eps))
    return np.stack(columns, axis=1) if columns else np.zeros((out_size, 0))


def _analytical_jacobian(out, inputs, i):
    from . import grad
    from ..tensor import Tensor
    rows = []
    for j in range(out.data.size):
        seed = np.zeros(out.data.size, dtype=out.data.dtype)
        seed[j] = 1
        (g,) = grad(out, inputs[i], Tensor(seed.reshape(out.shape)), retain_graph=True,
                    allow_unused=True)
        if g is not None and g.shape != inputs[i].shape:
            raise GradcheckError(f"gradient with respect to input {i} has shape "
                                 f"{list(g.shape)}, expected {list(inputs[i].shape)}")
        rows.append(np.zeros(inputs[i].data.size) if g is None else
                    np.asarray(g.data, dtype=np.float64).reshape(-1))
    return np.stack(rows, axis=0) if rows else np.zeros((0, inputs[i].data.size))


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True):
    """Compare autograd's Jacobians of ``fn(*inputs)`` with central finite differences.

    Inputs that require grad must be float64. Returns True, or raises GradcheckError
    (``raise_exception=False``: returns False) naming the output and input that disagree.
    """
    inputs = _as_tuple(inputs)
    for k, t in enumerate(inputs):
        if getattr(t, "requires_grad", False) and t.data.dtype != np.float64:
            raise ValueError(f"gradcheck: input {k} is {t.data.dtype}; finite differences need "
                             "float64 inputs (use .double())")
    outputs = _as_tuple(fn(*inputs))
    for o, out in enumerate(outputs):
        if out is None or not out.requires_grad:
            continue
        for i, t in enumerate(inputs):
            if not getattr(t, "requires_grad", False):
                continue
            analytical = _analytical_jacobian(out, inputs, i)
            numerical = _numerical_jacobian(fn, inputs, i, o, out.data.size, eps)
            if not np.allclose(analytical, numerical, atol=atol, rtol=rtol):
                if not raise_exception:
                    return False
                worst = np.unravel_index(np.argmax(np.abs(analytical - numerical)),
                                         analytical.shape)
                raise GradcheckError(
                    f"Jacobian mismatch for output {o} with respect to input {i}: at "
                    f"(output element, input element) {tuple(int(w) for w in worst)} autograd "
                    f"gives {analytical[worst]:.6g}, finite differences {numerical[worst]:.6g}\n"
                    f"analytical:\n{analytical}\nnumerical:\n{numerical}")
    return True


def gradgradcheck(fn, inputs, grad_outputs=None, eps=1e-6, atol=1e-5, rtol=1e-3,
                  raise_exception=True, seed=0):
    """gradcheck of the first derivative: checks ``create_graph=True`` second derivatives."""
    from . import grad
    from ..tensor import Tensor
    inputs = _as_tuple(inputs)
    outputs = _as_tuple(fn(*inputs))
    if grad_outputs is None:
        rng = np.random.default_rng(seed)
        grad_outputs = tuple(Tensor(rng.standard_normal(o.shape), requires_grad=True)
                             for o in outputs)
    diff = [k for k, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    n = len(inputs)

    def first_derivative(*args):
        xs, vs = args[:n], args[n:]
        outs = _as_tuple(fn(*xs))
        grads = grad(outs, [xs[k] for k in diff], vs, create_graph=True, allow_unused=True)
        return tuple(Tensor(np.zeros(xs[k].shape)) if g is None else g
                     for k, g in zip(diff, grads))

    return gradcheck(first_derivative, inputs + tuple(grad_outputs), eps, atol, rtol,
                     raise_exception)
