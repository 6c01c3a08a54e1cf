"""Differentiable collectives: values and gradients against the same computation in one process.

Each rank runs its part (its own inputs, its own loss) through hpcgrad.distributed.nn and calls
backward on its loss; the gradient each rank gets must be the gradient of the *sum* of all ranks'
losses. The reference builds that sum locally, from every rank's seeded inputs, with plain ops.
"""

import functools
import operator

import numpy as np
import pytest

import hpcgrad.distributed as dist
import hpcgrad.distributed.nn as dnn
from hpcgrad.distributed import ReduceOp
from hpcgrad.tensor import Tensor

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("world")]
SHAPE = (2, 3)


def data(rank, salt):
    return np.random.default_rng([salt, rank]).standard_normal(SHAPE)


def leaf(rank, salt):
    return Tensor(data(rank, salt), requires_grad=True)


def weight(*key):
    """A constant of the loss on the rank (and block) ``key``."""
    return Tensor(np.random.default_rng([99, *key]).standard_normal(SHAPE))


def total(terms):
    return functools.reduce(operator.add, terms)


def grad_of(t):
    return np.zeros(SHAPE) if t.grad is None else t.grad.array


def ranks():
    return range(dist.get_world_size())


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_all_reduce(op):
    me, n = dist.get_rank(), dist.get_world_size()
    scale = 1 / n if op is ReduceOp.AVG else 1

    def loss(rank, reduced):
        return (weight(rank) * reduced * reduced).sum()

    mine = leaf(me, 1)
    y = dnn.all_reduce(mine * 2, op)
    loss(me, y).backward()

    everyone = [leaf(r, 1) for r in ranks()]
    ref_y = total(x * 2 for x in everyone) * scale
    total(loss(r, ref_y) for r in ranks()).backward()
    np.testing.assert_allclose(y.array, ref_y.array, rtol=1e-12)
    np.testing.assert_allclose(mine.grad.array, everyone[me].grad.array, rtol=1e-12)


def test_broadcast():
    me, src = dist.get_rank(), dist.get_world_size() - 1

    def loss(rank, y):
        return (weight(rank) * y.tanh()).sum()

    mine = leaf(me, 2)
    y = dnn.broadcast(mine, src)
    loss(me, y).backward()

    everyone = [leaf(r, 2) for r in ranks()]
    total(loss(r, everyone[src]) for r in ranks()).backward()
    np.testing.assert_allclose(y.array, everyone[src].array)
    np.testing.assert_allclose(grad_of(mine), grad_of(everyone[me]), rtol=1e-12)  # 0 off src


@pytest.mark.parametrize("used", ["all", "first"])
def test_all_gather(used):
    """With ``first``, only block 0 reaches the loss: the other blocks' gradients are zeros."""
    me = dist.get_rank()
    blocks = list(ranks()) if used == "all" else [0]

    def loss(rank, gathered):
        return total((weight(rank, k) * gathered[k] ** 2).sum() for k in blocks)

    mine = leaf(me, 3)
    outs = dnn.all_gather(mine)
    loss(me, outs).backward()

    everyone = [leaf(r, 3) for r in ranks()]
    total(loss(r, everyone) for r in ranks()).backward()
    for out, x in zip(outs, everyone):
        np.testing.assert_allclose(out.array, x.array)
    np.testing.assert_allclose(grad_of(mine), grad_of(everyone[me]), rtol=1e-12)


def test_all_to_all():
    """Rank s's k-th input arrives as rank k's s-th output."""
    me = dist.get_rank()

    def loss(rank, received):
        return total((weight(rank, s) * received[s] ** 3).sum() for s in ranks())

    mine = [leaf(me, 10 + k) for k in ranks()]
    outs = dnn.all_to_all(mine)
    loss(me, outs).backward()

    everyone = {(s, k): leaf(s, 10 + k) for s in ranks() for k in ranks()}
    total(loss(r, [everyone[s, r] for s in ranks()]) for r in ranks()).backward()
    for s, out in zip(ranks(), outs):
        np.testing.assert_allclose(out.array, everyone[s, me].array)
    for k, x in zip(ranks(), mine):
        np.testing.assert_allclose(x.grad.array, everyone[me, k].grad.array, rtol=1e-12)


def test_no_grad_input_passes_through():
    x = Tensor(data(dist.get_rank(), 4))
    y = dnn.all_reduce(x)
    assert not y.requires_grad
    np.testing.assert_allclose(y.array, total(data(r, 4) for r in ranks()), rtol=1e-12)


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_other_reduce_ops_are_not_differentiable(op):
    with pytest.raises(NotImplementedError, match=f"a differentiable all_reduce supports SUM and "
                                                  f"AVG, not {op.name}"):
        dnn.all_reduce(leaf(dist.get_rank(), 5), op)
