"""Differentiable collectives: the backward of each is the matching collective on the gradients."""

from hpcgrad.autograd.function import Function
from hpcgrad.comm.process_group import ReduceOp
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.collectives import api


def _copy(t):
    return t.array.copy()


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, op, group):
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise NotImplementedError(f"a differentiable all_reduce supports SUM and AVG, not "
                                      f"{op.name}: MIN/MAX/PRODUCT gradients need the arg-extrema")
        ctx.op, ctx.group = op, group
        out = _copy(x)
        api.all_reduce(out, op, group)
        return out

    @staticmethod
    def backward(ctx, g):
        # d(sum_r x_r)/dx_me = 1 on every rank: each rank's input gets the sum of all output grads
        return _AllReduce.apply(g, ctx.op, ctx.group), None, None


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        out = _copy(x)
        api.broadcast(out, src, group)
        return out

    @staticmethod
    def backward(ctx, g):
        # Only src's input reaches the outputs: it collects every rank's gradient; others get 0.
        grad = _copy(g)
        api.reduce(grad, ctx.src, ReduceOp.SUM, ctx.group)
        if api.get_rank() != ctx.src:
            grad[...] = 0
        return Tensor(grad), None, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        gathered = [Tensor(x.array.copy()) for _ in range(api.get_world_size(group))]
        api.all_gather(gathered, x, group)
        return tuple(t.array for t in gathered)

    @staticmethod
    def backward(ctx, *grads):
        # My input is block ``me`` of every rank's outputs: sum those blocks across ranks.
        out = Tensor(grads[0].array.copy())
        api.reduce_scatter(out, [g.detach() for g in grads], ReduceOp.SUM, ctx.group)
        return out, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, group, *inputs):
        ctx.group = group
        outputs = [Tensor(t.array.copy()) for t in inputs]
        api.all_to_all(outputs, list(inputs), group)
        return tuple(t.array for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        # The transpose of a permutation of blocks is the inverse permutation: all_to_all again.
        back = [Tensor(g.array.copy()) for g in grads]
        api.all_to_all(back, [g.detach() for g in grads], ctx.group)
        return (None,) + tuple(back)


def all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """Differentiable all_reduce (out of place): returns the reduced tensor."""
    return _AllReduce.apply(tensor, op, group)


def broadcast(tensor, src, group=None):
    """Differentiable broadcast from ``src`` (out of place)."""
    return _Broadcast.apply(tensor, src, group)


def all_gather(tensor, group=None):
    """Differentiable all_gather: a tuple with every rank's tensor, in rank order."""
    return _AllGather.apply(tensor, group)


def all_to_all(input_tensor_list, group=None):
    """Differentiable all_to_all: returns the list of received tensors (equal shapes)."""
    return list(_AllToAll.apply(group, *input_tensor_list))
