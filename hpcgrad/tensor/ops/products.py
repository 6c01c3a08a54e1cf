"""Products of tensors: mm, bmm, matmul (method), dot, outer, einsum, diag, trace."""

import string

from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops._common_args import as_tensor, torch_name, xp_of
from hpcgrad.tensor.ops.common import function, method


def _both(fn):
    method(fn)
    function(fn)
    return fn


@_both
def mm(input, mat2):
    """Matrix product of two 2-D tensors."""
    input, mat2 = as_tensor(input), as_tensor(mat2)
    if input.ndim != 2:
        raise RuntimeError(f"self must be a matrix (got a {input.ndim}-D tensor)")
    if mat2.ndim != 2:
        raise RuntimeError(f"mat2 must be a matrix (got a {mat2.ndim}-D tensor)")
    _same_dtype(input, mat2)
    return input @ mat2


@_both
def bmm(input, mat2):
    """Batched matrix product of two 3-D tensors of one batch size."""
    input, mat2 = as_tensor(input), as_tensor(mat2)
    if input.ndim != 3:
        raise RuntimeError(f"batch1 must be a 3D tensor (got a {input.ndim}-D tensor)")
    if mat2.ndim != 3:
        raise RuntimeError(f"batch2 must be a 3D tensor (got a {mat2.ndim}-D tensor)")
    if input.shape[0] != mat2.shape[0]:
        raise RuntimeError(f"batch1 and batch2 must have same number of batches, got "
                           f"{input.shape[0]} and {mat2.shape[0]}")
    _same_dtype(input, mat2)
    return input @ mat2


def _same_dtype(a, b):
    if a.array.dtype != b.array.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: "
                           f"{torch_name(a.array.dtype)} != {torch_name(b.array.dtype)}")


@method
def matmul(self, other):
    return self @ other


@_both
def dot(input, tensor):
    """Inner product of two 1-D tensors of one length."""
    input, tensor = as_tensor(input), as_tensor(tensor)
    if input.ndim != 1 or tensor.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {input.ndim}D and {tensor.ndim}D "
                           "tensors")
    if input.shape[0] != tensor.shape[0]:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{input.shape[0]}] and "
                           f"src [{tensor.shape[0]}] to have the same number of elements, but "
                           f"got {input.shape[0]} and {tensor.shape[0]} elements respectively")
    if input.array.dtype != tensor.array.dtype:
        raise RuntimeError(f"dot : expected both vectors to have same dtype, but found "
                           f"{torch_name(input.array.dtype)} and {torch_name(tensor.array.dtype)}")
    return input @ tensor




@_both
def outer(input, vec2):
    """``input[i] * vec2[j]`` of two 1-D tensors."""
    input, vec2 = as_tensor(input), as_tensor(vec2)
    if input.ndim != 1 or vec2.ndim != 1:
        raise RuntimeError(f"outer: expected two 1-D tensors, got {input.ndim}-D and "
                           f"{vec2.ndim}-D")
    return input.reshape((-1, 1)) * vec2.reshape((1, -1))


@_both
def ger(input, vec2):
    """Alias of outer."""
    return outer(input, vec2)


# --- einsum --------------------------------------------------------------------------------------
def _parse(equation, shapes):
    """(input subscripts, output subscripts) with each '...' spelt out in spare letters."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(shapes):
        raise RuntimeError(f"einsum(): more operands were provided than specified in the "
                           f"equation ({len(shapes)} operands for {len(inputs)} subscripts)"
                           if len(shapes) > len(inputs) else
                           "einsum(): fewer operands were provided than specified in the "
                           f"equation ({len(shapes)} operands for {len(inputs)} subscripts)")
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    ell = max((len(shape) - len(s.replace("...", "")) for s, shape in zip(inputs, shapes)
               if "..." in s), default=0)
    letters = "".join(spare[:ell])
    spelt = []
    for s, shape in zip(inputs, shapes):
        if "..." in s:
            n = len(shape) - len(s.replace("...", ""))
            s = s.replace("...", letters[ell - n:])
        if len(s) != len(shape):
            raise RuntimeError(f"einsum(): the number of subscripts in the equation "
                               f"({len(s)}) does not match the number of dimensions "
                               f"({len(shape)}) for operand {len(spelt)}"
                               + (" and no ellipsis was given" if "..." not in s else ""))
        spelt.append(s)
    if arrow:
        out = rhs.replace("...", letters)
    else:  # implicit: the ellipsis dims, then the letters seen once, in alphabetical order
        counts = {}
        for s in spelt:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = letters + "".join(sorted(c for c, n in counts.items()
                                       if n == 1 and c not in letters))
    return spelt, out


class Einsum(Function):
    """numpy/cupy's einsum; the gradient of operand k is the einsum of the output's gradient
    with the other operands into operand k's subscripts (letters only operand k has, summed
    away in forward, come back by broadcasting)."""

    @staticmethod
    def forward(ctx, subscripts, out, *operands):
        ctx.subscripts, ctx.out = subscripts, out
        if ctx.needs_input_grad:
            ctx.save_for_backward(*operands)
        arrays = [o.array for o in operands]
        xp = xp_of(operands[0])
        result = xp.einsum(",".join(subscripts) + "->" + out, *arrays,
                           optimize=len(arrays) > 2)
        return xp.asarray(result)

    @staticmethod
    def backward(ctx, g):
        operands = ctx.saved_tensors
        subscripts, out = ctx.subscripts, ctx.out
        grads = []
        for k, (s, t) in enumerate(zip(subscripts, operands)):
            if not ctx.needs_input_grad[2 + k]:
                grads.append(None)
                continue
            others = [(o, x) for j, (o, x) in enumerate(zip(subscripts, operands)) if j != k]
            present = set(out).union(*[set(o) for o, _ in others])
            target = "".join(c for c in s if c in present)
            grad = _einsum([out] + [o for o, _ in others], target, [g] + [x for _, x in others])
            if target != s:  # letters summed out of this operand alone: broadcast back
                grad = grad.reshape(tuple(t.shape[i] if c in present else 1
                                          for i, c in enumerate(s))).expand(t.shape)
            grads.append(grad)
        return (None, None) + tuple(grads)


def _einsum(subscripts, out, operands):
    return Einsum.apply(tuple(subscripts), out, *operands)


@function
def einsum(equation, *operands):
    """Einstein summation, as torch.einsum (``'ij,jk->ik'``, implicit output, ``...``).

    Not built (NotImplementedError): a letter repeated within one operand's subscripts
    (``'ii->i'``, diagonals: the gradient would have to write into a diagonal), ellipsis dims
    that broadcast (sizes must match), and the sublist form ``einsum(a, [0, 1], b, [1, 2])``.
    """
    if not isinstance(equation, str):
        raise NotImplementedError("einsum: the sublist form einsum(op, [dims], ...) is not "
                                  "built; give the equation as a string, e.g. 'ij,jk->ik'")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    operands = tuple(as_tensor(o) for o in operands)
    subscripts, out = _parse(equation, [o.shape for o in operands])
    sizes = {}
    for k, (s, o) in enumerate(zip(subscripts, operands)):
        if len(set(s)) != len(s):
            raise NotImplementedError(f"einsum: subscript letters repeated within operand {k} "
                                      f"('{s}': a diagonal) are not built; take the diagonal "
                                      "first (torch.diagonal / diag), then einsum")
        for c, n in zip(s, o.shape):
            if sizes.setdefault(c, n) != n:
                raise RuntimeError(f"einsum(): subscript {c} has size {n} for operand {k} which "
                                   f"does not broadcast with previously seen size {sizes[c]}")
    for c in out:
        if c not in sizes:
            raise RuntimeError(f"einsum(): output subscript {c} does not appear in the "
                               "equation for any input operand")
    dtypes = {o.array.dtype for o in operands}
    if len(dtypes) > 1:
        first = operands[0].array.dtype
        other = next(d for d in dtypes if d != first)
        raise RuntimeError(f"expected scalar type {torch_name(first)} but found "
                           f"{torch_name(other)} (einsum's operands share one dtype)")
    return _einsum(subscripts, out, operands)


# --- diag and trace ------------------------------------------------------------------------------
class Diag(Function):
    """diag: a 1-D tensor onto diagonal ``k`` of a square matrix, or diagonal ``k`` of a
    matrix as a 1-D tensor. Each one's gradient is the other."""

    @staticmethod
    def forward(ctx, a, k):
        ctx.shape, ctx.k = a.array.shape, k
        xp = xp_of(a)
        return xp.diag(a.array, k).copy()

    @staticmethod
    def backward(ctx, g):
        if len(ctx.shape) == 1:
            return Diag.apply(g, ctx.k), None
        return DiagBackward.apply(g, ctx.shape, ctx.k), None


class DiagBackward(Function):
    """A 1-D tensor onto diagonal ``k`` of a zero matrix of ``shape`` (diag's gradient)."""

    @staticmethod
    def forward(ctx, g, shape, k):
        ctx.k = k
        xp = xp_of(g)
        out = xp.zeros(shape, g.array.dtype)
        rows = xp.arange(g.array.shape[0])
        out[rows + max(-k, 0), rows + max(k, 0)] = g.array
        return out

    @staticmethod
    def backward(ctx, gg):
        return Diag.apply(gg, ctx.k), None, None


@_both
def diag(input, diagonal=0):
    """1-D -> the square matrix with it on diagonal ``diagonal``; 2-D -> that diagonal."""
    input = as_tensor(input)
    if input.ndim not in (1, 2):
        raise RuntimeError(f"diag(): Supports 1D or 2D tensors. Got {input.ndim}D")
    return Diag.apply(input, int(diagonal))


@_both
def trace(input):
    """The sum of the main diagonal of a 2-D tensor (an integer one's is int64)."""
    input = as_tensor(input)
    if input.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {input.ndim}")
    d = Diag.apply(input, 0)
    return d.sum() if d.array.dtype.kind in "fc" else d.long().sum()
