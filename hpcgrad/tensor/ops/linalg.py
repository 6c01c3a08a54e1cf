"""Matrix product with numpy's rules: 1-D operands, and batched (broadcast) leading axes."""

from hpcgrad.base import blas
from hpcgrad.autograd.function import Function


def matmul_arrays(x, y):
    """``x @ y``; a stack of matrices times one matrix as one 2-D product over the merged rows.

    numpy multiplies a stack (..., m, k) by a matrix one slice at a time, and not with BLAS
    where the matrix is a transposed view (``w.T``): a GPT's (8, 128, 256) @ (768, 256).T took
    32 ms where the same rows as one (1024, 256) product took 8 ms. Each output element is
    the same sum of the same k products either way. The products go through base/blas.py
    (Note [MKL for the products])."""
    if x.ndim > 2 and y.ndim == 2:
        rows = x.reshape(-1, x.shape[-1])
        return blas.matmul(rows, y).reshape(x.shape[:-1] + (y.shape[-1],))
    return blas.matmul(x, y)


def _column_major(a):
    """Whether ``a`` is a matrix stored column by column (its transpose C-contiguous), as a
    transposed weight ``w.T`` is.

    Note [A transposed weight's gradient]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``x @ w.T``'s gradient of ``w.T`` is ``x^T @ g``; as ``(g^T @ x)^T`` it is the same sums,
    stored as ``w.T`` is (PyTorch's ``mm_mat2_backward`` does so), and its transpose, ``w``'s
    gradient, C-contiguous. MKL's speed differs between the two where g holds subnormal
    floats, as a saturated softmax's gradient does (a GPT's tied head, N(0, 1) embeddings):
    (256, 1024) @ (1024, 256) took 64 ms with g as the right operand and 8 with it as the left
    (1.4 without subnormals; PyTorch's product took 72 ms and 7 the same ways)."""
    return a.ndim == 2 and a.shape[0] > 1 and a.strides == (a.itemsize, a.itemsize * a.shape[0])


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        needs = ctx.needs_input_grad
        if needs:  # each gradient uses the other operand only (PyTorch's mm saves per input)
            ctx.ndims = (a.array.ndim, b.array.ndim)
            ctx.b_by_columns = needs[1] and _column_major(b.array)
            ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
        return matmul_arrays(a.array, b.array)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        a_ndim, b_ndim = ctx.ndims
        grad_a = grad_b = None
        if a_ndim == 1 and b_ndim == 1:
            return (g * b if need_a else None), (g * a if need_b else None)
        if a_ndim == 1:  # (k) @ (..., k, n) -> (..., n)
            if need_a:
                grad_a = (g.unsqueeze(-2) @ b.mT).squeeze(-2)
            if need_b:
                grad_b = a.unsqueeze(-1) @ g.unsqueeze(-2)
        elif b_ndim == 1:  # (..., m, k) @ (k) -> (..., m)
            if need_a:
                grad_a = g.unsqueeze(-1) @ b.unsqueeze(-2)
            if need_b:
                grad_b = (a.mT @ g.unsqueeze(-1)).squeeze(-1)
        else:
            if need_a:
                grad_a = g @ b.mT
            if need_b and ctx.b_by_columns:
                # Note [A transposed weight's gradient]
                grad_b = (g.reshape(-1, g.shape[-1]).mT @ a.reshape(-1, a.shape[-1])).mT
            elif need_b and a_ndim > 2 and b_ndim == 2:
                # one product over the merged rows, not one per matrix of the stack summed after
                grad_b = a.reshape(-1, a.shape[-1]).mT @ g.reshape(-1, g.shape[-1])
            elif need_b:
                grad_b = a.mT @ g
        return grad_a, grad_b  # broadcast batch axes are summed back by the engine
