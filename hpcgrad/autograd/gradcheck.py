"""Finite-difference checks of first and second derivatives, as PyTorch's gradcheck (float64)."""

import warnings

import numpy as np


class GradcheckError(RuntimeError):
    """Analytical and numerical derivatives disagree (or backward misbehaves)."""


_FAST_FAIL_SLOW_OK = (
    "Fast gradcheck failed but element-wise differences are small: the check might pass in "
    "slow mode. If the function is right, call gradcheck with fast_mode=False.")

_NONDET_HINT = (
    "If the backward is meant to be non-deterministic (atomic adds, random rounding), pass "
    "nondet_tol=<tolerance> to gradcheck/gradgradcheck.")


def _as_tuple(x):
    return x if isinstance(x, tuple) else tuple(x) if isinstance(x, list) else (x,)


def _is_tensor(x):
    from hpcgrad.tensor._tensor import Tensor
    return isinstance(x, Tensor)


def _requires_grad(x):
    return _is_tensor(x) and x.requires_grad


def _differentiable_outputs(outputs):
    return tuple(o for o in outputs if _requires_grad(o))


def _is_float(array):
    return np.issubdtype(array.dtype, np.floating)


# --- checks of the inputs and outputs ----------------------------------------------------------

def _check_inputs(inputs):
    """At least one input requires grad; warn when one is not float64; no stride-0 inputs."""
    any_requires_grad = False
    for idx, t in enumerate(inputs):
        if not _requires_grad(t):
            continue
        any_requires_grad = True
        if t.array.dtype != np.float64:
            warnings.warn(f"Input #{idx} requires gradient and is not a double precision floating "
                          f"point ({t.array.dtype}). This check will likely fail if all the inputs "
                          "are not of double precision floating point (use .double()).",
                          UserWarning, stacklevel=3)
        # (numpy gives empty arrays zero strides: they have no elements to overlap)
        if t.array.size and any(st == 0 and sz > 1 for st, sz in zip(t.array.strides,
                                                                    t.array.shape)):
            raise RuntimeError(
                f"The {idx}th input has a dimension with stride 0. gradcheck only supports "
                "inputs that are non-overlapping to be able to compute the numerical gradients "
                "correctly (a perturbation would move several elements at once). You should call "
                ".contiguous() on the input before passing it to gradcheck.")
    if not any_requires_grad:
        raise ValueError("gradcheck expects at least one input tensor to require gradient, but "
                         "none of them have requires_grad=True.")


def _check_same_dtype_and_shape(out, perturbed, eps, idx):
    if out.shape != perturbed.shape:
        raise AssertionError(
            f"Expected `func` to return outputs with the same shape when inputs are perturbed "
            f"on index {idx} by {eps}, but got: shapes {tuple(out.shape)} and "
            f"{tuple(perturbed.shape)}.")
    if out.array.dtype != perturbed.array.dtype:
        raise AssertionError(
            f"Expected `func` to return outputs with the same dtype when inputs are perturbed "
            f"on index {idx} by {eps}, but got: dtypes {out.array.dtype} and "
            f"{perturbed.array.dtype}.")


# --- numerical derivatives ---------------------------------------------------------------------

def _outputs_at(fn, inputs, outputs, eps, idx):
    """``fn(*inputs)``'s float outputs as flat float64 arrays (others as None), checked against
    ``outputs`` for shape and dtype."""
    result = []
    for out, new in zip(outputs, _as_tuple(fn(*inputs))):
        if not _is_tensor(out):
            result.append(None)
            continue
        _check_same_dtype_and_shape(out, new, eps, idx)
        # A copy: the output may be a view of the input that is perturbed next.
        result.append(np.array(new.array, dtype=np.float64).reshape(-1)
                      if _is_float(out.array) else None)
    return result


def _numerical_jacobians(fn, inputs, i, outputs, eps):
    """d outputs[o] / d inputs[i] for every output o (zeros for non-float ones), by central
    differences, column by column: a list of (output size, input size) arrays."""
    x = inputs[i].array
    columns = [[] for _ in outputs]
    # Not under no_grad: fn may itself differentiate (gradgradcheck's first derivative).
    # Index x itself (C order, as the analytical rows): reshape(-1) of a non-contiguous input
    # would be a copy, and the perturbation would never reach fn.
    for k in np.ndindex(x.shape):
        orig = x[k].copy()
        x[k] = orig + eps
        plus = _outputs_at(fn, inputs, outputs, eps, k)
        x[k] = orig - eps
        minus = _outputs_at(fn, inputs, outputs, eps, k)
        x[k] = orig
        for o, (p, m) in enumerate(zip(plus, minus)):
            columns[o].append(None if p is None else (p - m) / (2 * eps))
    jacobians = []
    for o, out in enumerate(outputs):
        size = out.array.size if _is_tensor(out) else 0
        cols = [np.zeros(size) if c is None else c for c in columns[o]]
        jacobians.append(np.stack(cols, axis=1) if cols else np.zeros((size, 0)))
    return jacobians


def _numerical_jvps(fn, inputs, i, outputs, u, eps):
    """J_o u for every output o, perturbing input i along direction u (fast mode)."""
    x = inputs[i].array
    orig = x.copy()
    step = (eps * u).reshape(x.shape)
    try:
        x[...] = orig + step
        plus = _outputs_at(fn, inputs, outputs, eps, None)
        x[...] = orig - step
        minus = _outputs_at(fn, inputs, outputs, eps, None)
    finally:
        x[...] = orig
    return [np.zeros(o.array.size if _is_tensor(o) else 0) if p is None else (p - m) / (2 * eps)
            for o, p, m in zip(outputs, plus, minus)]


# --- analytical derivatives --------------------------------------------------------------------

def _vjp(out, diff_inputs, v, check_grad_dtypes):
    """v^T J for each differentiable input, as flat float64 arrays (zeros for an unused input)."""
    from hpcgrad.autograd import grad
    from hpcgrad.tensor._tensor import Tensor
    grads = grad(out, diff_inputs, Tensor(v.reshape(out.shape).astype(out.array.dtype)),
                 retain_graph=True, allow_unused=True)
    rows = []
    for k, (g, t) in enumerate(zip(grads, diff_inputs)):
        if g is None:
            rows.append(np.zeros(t.array.size))
            continue
        if g.shape != t.shape:
            raise GradcheckError(f"Analytical gradient has incorrect size: the gradient with "
                                 f"respect to differentiable input {k} has shape "
                                 f"{list(g.shape)}, expected {list(t.shape)}")
        if check_grad_dtypes and g.array.dtype != t.array.dtype:
            raise GradcheckError(f"Gradient has dtype mismatch: {g.array.dtype} for an input of "
                                 f"{t.array.dtype}")
        rows.append(np.asarray(g.array, dtype=np.float64).reshape(-1))
    return rows


def _analytical(out, diff_inputs, seeds, nondet_tol, check_grad_dtypes):
    """For each seed v (rows of the Jacobian, or one random v in fast mode): v^T J per input,
    computed twice: the two runs must agree within nondet_tol (a reentrant backward)."""
    runs = []
    for _ in range(2):
        per_seed = [_vjp(out, diff_inputs, v, check_grad_dtypes) for v in seeds]
        runs.append([np.stack([rows[k] for rows in per_seed], axis=0) if per_seed
                     else np.zeros((0, t.array.size)) for k, t in enumerate(diff_inputs)])
    for first, second in zip(*runs):
        if first.size and np.abs(first - second).max() > nondet_tol:
            raise GradcheckError(
                "Backward is not reentrant, i.e., running backward with same input and "
                "grad_output multiple times gives different values, although analytical "
                "gradient matches numerical gradient. The tolerance for nondeterminism was "
                f"{nondet_tol}. " + _NONDET_HINT)
    return runs[0]


def _unit_rows(size, dtype):
    eye = np.eye(size, dtype=dtype)
    return [eye[j] for j in range(size)]


# --- the two modes ---------------------------------------------------------------------------

def _mismatch_message(o, i, numerical, analytical):
    diff = np.abs(analytical - numerical)
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    return (f"Jacobian mismatch for output {o} with respect to input {i},\n"
            f"at (output element, input element) {tuple(int(w) for w in worst)} autograd gives "
            f"{analytical[worst]:.6g}, finite differences {numerical[worst]:.6g}\n"
            f"numerical:\n{numerical}\nanalytical:\n{analytical}\n")


def _slow_gradcheck(fn, inputs, outputs, diff_in, diff_out, eps, atol, rtol, nondet_tol,
                    check_grad_dtypes):
    numerical = {i: _numerical_jacobians(fn, inputs, i, outputs, eps) for i in diff_in}
    if not diff_out:
        for i in diff_in:
            if any(np.any(j != 0) for j in numerical[i]):
                raise GradcheckError("Numerical gradient for function expected to be zero: no "
                                     "output requires grad, but the outputs change with input "
                                     f"{i} (is an output detached or recomputed from .data?)")
        return
    diff_inputs = [inputs[i] for i in diff_in]
    for o in diff_out:
        out = outputs[o]
        analytical = _analytical(out, diff_inputs, _unit_rows(out.array.size, np.float64),
                                 nondet_tol, check_grad_dtypes)
        for i, a in zip(diff_in, analytical):
            n = numerical[i][o]
            if not np.allclose(a, n, rtol=rtol, atol=atol):
                raise GradcheckError(_mismatch_message(o, i, n, a))


def _random_unit(rng, size):
    """A random non-negative direction of norm 1 (PyTorch's fast-mode vectors)."""
    vec = rng.random(size)
    norm = np.linalg.norm(vec)
    return vec / norm if norm else vec


def _fast_gradcheck(fn, inputs, outputs, diff_in, diff_out, eps, atol, rtol, nondet_tol,
                    check_grad_dtypes):
    """Compare v^T J u, analytical (one backward per output) against numerical (one pair of
    perturbed calls per input), for random u per input and v per output."""
    rng = np.random.default_rng(0)  # its own generator: the caller's random state is untouched
    all_u = {i: _random_unit(rng, inputs[i].array.size) for i in diff_in}
    all_v = {o: _random_unit(rng, outputs[o].array.size) for o in diff_out}
    jvps = {i: _numerical_jvps(fn, inputs, i, outputs, all_u[i], eps) for i in diff_in}
    if not diff_out:
        for i in diff_in:
            if any(j.size and np.abs(j).max() > nondet_tol for j in jvps[i]):
                raise GradcheckError("Numerical gradient for function expected to be zero: no "
                                     "output requires grad, but the outputs change with input "
                                     f"{i} (is an output detached or recomputed from .data?)")
        return
    diff_inputs = [inputs[i] for i in diff_in]
    for o in diff_out:
        v = all_v[o]
        vjs = _analytical(outputs[o], diff_inputs, [v], nondet_tol, check_grad_dtypes)
        for i, vj in zip(diff_in, vjs):
            u = all_u[i]
            analytical = float(vj[0] @ u)
            numerical = float(v @ jvps[i][o])
            # |v^T (A - N) u| <= atol * sum(v) * sum(u) when every |A - N| entry is <= atol.
            adjusted_atol = atol * float(u.sum()) * float(v.sum())
            if not np.isclose(analytical, numerical, rtol=rtol, atol=adjusted_atol):
                raise GradcheckError(
                    f"Jacobian mismatch for output {o} with respect to input {i} (fast mode: "
                    f"v^T J u for random u, v),\nnumerical:{numerical!r}\n"
                    f"analytical:{analytical!r}\n" + _slow_mode_report(
                        fn, inputs, outputs, diff_in, o, i, eps, atol, rtol))


def _slow_mode_report(fn, inputs, outputs, diff_in, o, i, eps, atol, rtol):
    """The full Jacobians of one (output, input) pair, for the error of a failed fast check."""
    numerical = _numerical_jacobians(fn, inputs, i, outputs, eps)[o]
    diff_inputs = [inputs[k] for k in diff_in]
    rows = [_vjp(outputs[o], diff_inputs, v, False)[diff_in.index(i)]
            for v in _unit_rows(outputs[o].array.size, np.float64)]
    analytical = np.stack(rows, axis=0) if rows else np.zeros((0, inputs[i].array.size))
    report = ("\nThe quantities above are computed in fast mode. In slow mode:\n"
              f"numerical:\n{numerical}\nanalytical:\n{analytical}\n")
    if analytical.size:
        report += (f"The max per-element difference (slow mode) is: "
                   f"{np.abs(analytical - numerical).max()}.\n")
    if np.allclose(analytical, numerical, rtol=rtol, atol=atol):
        report += _FAST_FAIL_SLOW_OK
    return report


# --- checks of backward's behaviour beyond its values -------------------------------------------

def _test_backward_mul_by_grad_output(outputs, inputs, diff_in):
    """Zero output gradients must give zero (or no) input gradients, of the inputs' shape."""
    from hpcgrad.autograd import grad
    from hpcgrad.tensor._tensor import Tensor
    diff_inputs = [inputs[i] for i in diff_in]
    zeros = [Tensor(np.zeros(o.shape, dtype=o.array.dtype)) for o in outputs]
    grads = grad(outputs, diff_inputs, zeros, allow_unused=True)
    for gi, di in zip(grads, diff_inputs):
        if gi is None:
            continue
        if np.any(np.asarray(gi.array) != 0):
            raise GradcheckError("backward not multiplied by grad_output: zero output "
                                 "gradients gave a non-zero input gradient (does a hook or "
                                 "backward add a constant?)")
        if gi.array.dtype != di.array.dtype:
            raise GradcheckError(f"grad is incorrect type ({gi.array.dtype} is not "
                                 f"{di.array.dtype})")
        if gi.shape != di.shape:
            raise GradcheckError(f"grad is incorrect size ({list(gi.shape)} is not "
                                 f"{list(di.shape)})")


def _test_undefined_backward_mode(fn, inputs, diff_in):
    """Backward must cope with undefined (None) output gradients: all of them at once, and, with
    several outputs, each one alone (the others zero); input gradients are then None or zero."""
    from hpcgrad.tensor._tensor import Tensor
    from hpcgrad.autograd.engine import get_default_engine
    diff_inputs = [inputs[i] for i in diff_in]

    def undefined_support(outputs, undefined):
        grads = [None if k in undefined else Tensor(np.zeros(o.shape, dtype=o.array.dtype))
                 for k, o in enumerate(outputs)]
        try:
            # Through the engine: autograd.grad would turn a None gradient into ones.
            result = get_default_engine().execute(
                [o._gradient_edge() for o in outputs], grads, False, False, False,
                [t._gradient_edge() for t in diff_inputs])
        except RuntimeError as exc:
            _warn_undefined_check()
            raise GradcheckError("Expected backward function to handle undefined output grads "
                                 f"(None); it raised {type(exc).__name__}: {exc}") from exc
        for gi in result:
            if gi is not None and np.any(np.asarray(gi.array) != 0):
                _warn_undefined_check()
                raise GradcheckError("Expected all input grads to be undefined or zero when all "
                                     "output grads are undefined or zero.")

    outputs = _differentiable_outputs(_as_tuple(fn(*inputs)))
    undefined_support(outputs, set(range(len(outputs))))
    if len(outputs) > 1:
        for k in range(len(outputs)):
            undefined_support(_differentiable_outputs(_as_tuple(fn(*inputs))), {k})


def _warn_undefined_check():
    warnings.warn("Backwards compatibility: New undefined gradient support checking feature is "
                  "enabled by default, but it may break existing callers of this function. If "
                  "this is true for you, you can call this function with "
                  "check_undefined_grad=False to disable the feature", UserWarning, stacklevel=4)


# --- entry points ----------------------------------------------------------------------------

def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True, *,
              nondet_tol=0.0, check_undefined_grad=True, check_grad_dtypes=False,
              check_batched_grad=False, check_batched_forward_grad=False,
              check_forward_ad=False, check_backward_ad=True, fast_mode=False, masked=None):
    """Compare autograd's derivatives of ``fn(*inputs)`` with central finite differences.

    Checks every output that requires grad against every input that requires grad (inputs
    should be float64; others warn). With no differentiable output, the outputs must not
    change with the inputs. ``fast_mode`` compares v^T J u for random u, v instead of whole
    Jacobians; ``nondet_tol`` bounds how much two runs of backward may differ. Also checks that
    zero output gradients give zero input gradients and (``check_undefined_grad``) that
    backward copes with None output gradients. Returns True, or raises GradcheckError naming
    what disagrees (``raise_exception=False``: returns False instead; other errors still raise).
    """
    if check_batched_grad or check_batched_forward_grad:
        raise NotImplementedError("gradcheck: hpcgrad has no batched (vmap) gradients to check; "
                                  "call it with check_batched_grad=False")
    if check_forward_ad:
        raise NotImplementedError("gradcheck: hpcgrad has no forward-mode AD to check; call it "
                                  "with check_forward_ad=False")
    if not check_backward_ad:
        raise ValueError("Expected at least one of check_forward_ad or check_backward_ad to be "
                         "True (hpcgrad checks backward mode only)")
    if masked:
        raise NotImplementedError("gradcheck: masked=True applies to sparse inputs; hpcgrad's "
                                  "inputs are dense (leave masked unset)")
    inputs = _as_tuple(inputs)
    _check_inputs(inputs)
    try:
        outputs = _as_tuple(fn(*inputs))
        diff_in = [k for k, t in enumerate(inputs) if _requires_grad(t)]
        diff_out = [k for k, o in enumerate(outputs) if _requires_grad(o)]
        check = _fast_gradcheck if fast_mode else _slow_gradcheck
        check(fn, inputs, outputs, diff_in, diff_out, eps, atol, rtol, nondet_tol,
              check_grad_dtypes)
        diff_outputs = [outputs[o] for o in diff_out]
        if diff_outputs:
            _test_backward_mul_by_grad_output(diff_outputs, inputs, diff_in)
            if check_undefined_grad:
                _test_undefined_backward_mode(fn, inputs, diff_in)
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True


def gradgradcheck(fn, inputs, grad_outputs=None, eps=1e-6, atol=1e-5, rtol=1e-3,
                  raise_exception=True, seed=0, *, gen_non_contig_grad_outputs=False,
                  nondet_tol=0.0, check_undefined_grad=True, check_grad_dtypes=False,
                  check_batched_grad=False, check_fwd_over_rev=False, check_rev_over_rev=True,
                  fast_mode=False, masked=False):
    """gradcheck of the first derivative: checks ``create_graph=True`` second derivatives.

    ``grad_outputs`` default: random values in [-1, 1) (from ``seed``) that require grad, one
    per differentiable output (non-contiguous with ``gen_non_contig_grad_outputs``).
    """
    from hpcgrad.autograd import grad
    from hpcgrad.tensor._tensor import Tensor
    if check_fwd_over_rev:
        raise NotImplementedError("gradgradcheck: hpcgrad has no forward-mode AD to check; call "
                                  "it with check_fwd_over_rev=False")
    if not check_rev_over_rev:
        raise ValueError("Expected at least one of check_fwd_over_rev or check_rev_over_rev to "
                         "be True (hpcgrad checks reverse over reverse only)")
    inputs = _as_tuple(inputs)
    if grad_outputs is None:
        rng = np.random.default_rng(seed)
        grad_outputs = []
        for o in _differentiable_outputs(_as_tuple(fn(*inputs))):
            dtype = o.array.dtype if _is_float(o.array) else np.float64
            if gen_non_contig_grad_outputs and o.array.size > 1:
                wide = rng.uniform(-1, 1, o.shape + (2,)).astype(dtype)
                values = wide[..., 0]  # a strided view: every other element
            else:
                values = rng.uniform(-1, 1, o.shape).astype(dtype)
            grad_outputs.append(Tensor(values, requires_grad=True))
    grad_outputs = _as_tuple(grad_outputs)
    diff = [k for k, t in enumerate(inputs) if _requires_grad(t)]
    n = len(inputs)

    def first_derivative(*args):
        xs, vs = args[:n], args[n:]
        outs = _differentiable_outputs(_as_tuple(fn(*xs)))
        grads = grad(outs, [xs[k] for k in diff], vs, create_graph=True, allow_unused=True)
        return tuple(g for g in grads if g is not None)

    return gradcheck(first_derivative, inputs + grad_outputs, eps, atol, rtol, raise_exception,
                     nondet_tol=nondet_tol, check_undefined_grad=check_undefined_grad,
                     check_grad_dtypes=check_grad_dtypes, check_batched_grad=check_batched_grad,
                     fast_mode=fast_mode, masked=masked)
