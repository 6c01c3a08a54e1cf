"""Matrix product with numpy's rules: 1-D operands, and batched (broadcast) leading axes."""

from ..autograd.function import Function


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        needs = ctx.needs_input_grad
        if needs:  # each gradient uses the other operand only (PyTorch's mm saves per input)
            ctx.ndims = (a.array.ndim, b.array.ndim)
            ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
        return a.array @ b.array

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
            if need_b:
                grad_b = a.mT @ g
        return grad_a, grad_b  # broadcast batch axes are summed back by the engine
