"""What a graph keeps alive for backward, and when a second backward is allowed: PyTorch's choices.

PyTorch's derivatives.yaml saves, for each input that needs a gradient, only what that input's
formula reads (``y / 2`` saves the 2, not y; ``y * c`` saves c), frees what it saved after
backward (so a second backward through such a Node raises "Trying to backward through the graph
a second time"), and keeps only sizes for slicing, reshape, sum, mean, cat and expand (so a second
backward through those is allowed). Index tensors (integer and boolean indexing, gather,
index_select, max(dim)) and where's condition are saved tensors: freed like the others.

Ports (in our words): TestAutograd.test_free_unneeded_tensor (CUDA memory counters there, weakrefs
here), test_backward_twice_with_saved_values, test_backward_twice_retained_graph_with_saved_values,
test_backward_twice_without_saved_values, test_backward_twice_retained_graph_without_saved_values
(``c[[1, 2]] = b[[1, 1]]`` there, ``b[[1, 1]]`` here: written before in-place ops existed; they are
tested in test_autograd_inplace.py).
Left out: test_no_unnecessary_save (not ported yet).
"""

import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg

from autograd_helpers import assert_close, leaf, randn

RELEASED = "backward through the graph a second time"


def _intermediate(shape=(3, 4), seed=0):
    """(leaf x, y = x * 3): y requires grad, and nothing but the caller holds y or its array."""
    x = leaf(np.random.default_rng(seed).uniform(0.5, 2.0, shape))  # log and sqrt stay real
    return x, x * 3.0


def kept_alive(op):
    """Whether ``z = op(y)`` keeps y's Tensor or y's array alive once the caller drops y."""
    x, y = _intermediate()
    z = op(y)
    refs = (weakref.ref(y), weakref.ref(y.array))
    del y
    gc.collect()
    alive = any(r() is not None for r in refs)
    return alive, x, z


C = hg.tensor(np.arange(1.0, 5.0))           # a constant that needs no gradient
W = hg.tensor(np.arange(12.0).reshape(4, 3))

# Ops whose PyTorch backward saves nothing of y (a constant operand, the result, or sizes).
NOT_SAVED = {
    "div_by_number": lambda y: y / 2,
    "div_by_constant": lambda y: y / C,
    "mul_by_number": lambda y: y * 2,
    "number_times": lambda y: 2 * y,
    "mul_by_constant": lambda y: y * C,
    "add": lambda y: y + 2,
    "sub": lambda y: 1 - y,
    "neg": lambda y: -y,
    "exp": lambda y: y.exp(),          # saves its result
    "sqrt": lambda y: y.exp().sqrt(),  # saves its result
    "tanh": lambda y: y.tanh(),
    "sigmoid": lambda y: y.sigmoid(),
    "relu": lambda y: y.relu(),
    "softmax": lambda y: y.softmax(-1),
    "log_softmax": lambda y: y.log_softmax(-1),
    "matmul_constant_right": lambda y: y @ W,
    "matmul_constant_left": lambda y: W.T @ y.T,
    "sum": lambda y: y.sum(),
    "mean": lambda y: y.mean(1),
    "cast": lambda y: y.float(),
    "clone": lambda y: y.clone(),
    "cat": lambda y: hg.cat([y, y], 1),
    "pow_of_constant_base": lambda y: 2.0 ** y,  # saves the result and the exponent... see below
}
# Ops whose PyTorch backward does save y (its formula reads y): kept until backward frees it.
SAVED = {
    "mul_both": lambda y: y * hg.ones(3, 4).requires_grad_(),
    "div_by_tensor_needing_grad": lambda y: C / y,
    "pow_number": lambda y: y ** 2,
    "log": lambda y: y.log(),
    "abs": lambda y: y.abs(),
    "clamp": lambda y: y.clamp(-1, 1),
    "var": lambda y: y.var(1),
    "gelu": lambda y: hg.gelu(y),
}
# 2.0 ** y saves the exponent y in PyTorch too (pow.Scalar: exponent and result).
SAVED["pow_of_constant_base"] = NOT_SAVED.pop("pow_of_constant_base")


@pytest.mark.parametrize("name", NOT_SAVED)
def test_result_does_not_keep_the_input(name):
    alive, _, _ = kept_alive(NOT_SAVED[name])
    assert not alive, f"{name}: the graph keeps y alive, PyTorch's backward saves nothing of y"


@pytest.mark.parametrize("name", SAVED)
def test_saved_input_lives_until_backward_frees_it(name):
    x, y = _intermediate()
    z = SAVED[name](y)
    refs = (weakref.ref(y), weakref.ref(y.array))
    del y
    gc.collect()
    assert any(r() is not None for r in refs), f"{name}: PyTorch saves y for backward"
    z.sum().backward()
    gc.collect()
    assert all(r() is None for r in refs), f"{name}: saved y still alive after backward"
    assert x.grad is not None


def test_free_unneeded_tensor():
    # Neither x + 2 nor (x + 2) * m is kept for backward: m needs no gradient, so only m is saved.
    x = randn(2, 3, 10, 10)
    m = randn(1, 3, 1, 1, requires_grad=False, seed=1)
    kept = []

    def forward():
        shifted = x + 2
        product = shifted * m
        kept.extend([weakref.ref(shifted.array), weakref.ref(product.array)])
        return product.sum()

    z = forward()
    gc.collect()
    assert [r() for r in kept] == [None, None]
    z.backward()
    assert_close(x.grad, np.broadcast_to(m.array, x.shape))


# --- a second backward -------------------------------------------------------------------------

def test_backward_twice_with_saved_values():
    b = randn(3)
    c = b[[1, 1]]  # integer-array indexing saves the index, as PyTorch's IndexBackward0
    c.backward(leaf([1.0, 1.0], requires_grad=False))
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        c.backward(leaf([1.0, 1.0], requires_grad=False))


def test_backward_twice_retained_graph_with_saved_values():
    b = randn(3)
    c = b[[1, 1]]
    c.backward(leaf([1.0, 1.0], requires_grad=False), retain_graph=True)
    c.backward(leaf([1.0, 1.0], requires_grad=False))
    assert_close(b.grad, [0.0, 4.0, 0.0])


def test_backward_twice_without_saved_values():
    b = randn(3)
    c = b + 1
    c.backward(leaf([1.0, 1.0, 1.0], requires_grad=False))
    c.backward(leaf([1.0, 1.0, 1.0], requires_grad=False))
    assert_close(b.grad, [2.0, 2.0, 2.0])


def test_backward_twice_retained_graph_without_saved_values():
    b = randn(3)
    c = b + 1
    c.backward(leaf([1.0, 1.0, 1.0], requires_grad=False), retain_graph=True)
    c.backward(leaf([1.0, 1.0, 1.0], requires_grad=False))
    assert_close(b.grad, [2.0, 2.0, 2.0])


IDX = np.array([0, 0, 2])
# PyTorch's backward of these saves a tensor (an index, a mask, a result, an operand): the second
# backward raises. Checked against torch 2.13.
SECOND_BACKWARD_RAISES = {
    "integer_array_index": lambda x: x[IDX].sum(),
    "list_index": lambda x: x[[2, 0]].sum(),
    "boolean_mask": lambda x: x[x.array > 0].sum(),
    "mixed_slice_and_array": lambda x: x[1:, IDX].sum(),
    "gather": lambda x: x.gather(1, np.array([[0], [1], [2]])).sum(),
    "index_select": lambda x: x.index_select(1, np.array([0, 3])).sum(),
    "max_dim": lambda x: x.max(1).values.sum(),
    "max": lambda x: x.max(),
    "amax": lambda x: x.amax(1).sum(),
    "where": lambda x: hg.where(x.array > 0, x, 0.0).sum(),
    "mul_by_number": lambda x: (x * 2).sum(),
    "div_by_number": lambda x: (x / 2).sum(),
    "exp": lambda x: x.exp().sum(),
    "softmax": lambda x: x.softmax(1).sum(),
}
# PyTorch's backward of these keeps sizes only: a second backward runs and accumulates again.
SECOND_BACKWARD_ALLOWED = {
    "slice": lambda x: x[1:3].sum(),
    "int_index": lambda x: x[1, 2],
    "ellipsis_and_newaxis": lambda x: x[..., None, 0].sum(),
    "reshape": lambda x: x.reshape(12).sum(),
    "flatten": lambda x: x.flatten().sum(),
    "squeeze": lambda x: x.unsqueeze(0).squeeze(0).sum(),
    "permute": lambda x: x.T.sum(),
    "expand": lambda x: x[:1].expand(5, 4).sum(),
    "cat": lambda x: hg.cat([x, x]).sum(),
    "stack": lambda x: hg.stack([x, x]).sum(),
    "add_number": lambda x: (x + 2).sum(),
    "sub": lambda x: (x - 1).sum(),
    "neg": lambda x: (-x).sum(),
    "mean": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(1).sum(),
    "broadcast_add": lambda x: (x + hg.ones(2, 3, 4)).sum(),
    "cast": lambda x: x.float().sum(),
    "clone": lambda x: x.clone().sum(),
}


@pytest.mark.parametrize("name", SECOND_BACKWARD_RAISES)
def test_second_backward_through_saved_tensors_raises(name):
    x = randn(3, 4)
    y = SECOND_BACKWARD_RAISES[name](x)
    y.backward()
    with pytest.raises(RuntimeError, match=RELEASED):
        y.backward()


@pytest.mark.parametrize("name", SECOND_BACKWARD_ALLOWED)
def test_second_backward_without_saved_tensors_runs(name):
    x = randn(3, 4)
    y = SECOND_BACKWARD_ALLOWED[name](x)
    y.backward()
    first = x.grad.array.copy()
    y.backward()
    assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("name", ["integer_array_index", "gather", "where", "max_dim"])
def test_retain_graph_keeps_index_for_second_backward(name):
    x = randn(3, 4)
    y = SECOND_BACKWARD_RAISES[name](x)
    y.backward(retain_graph=True)
    first = x.grad.array.copy()
    y.backward()
    assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("name", ["integer_array_index", "boolean_mask", "gather"])
def test_second_order_through_indexing(name):
    # The index the forward op saved is saved again by its backward op (whose own backward
    # indexes with it), so create_graph works: for y = s ** 2 with s = sum(x[index]) and
    # c = ds/dx (how often each element is picked), d(sum dy/dx)/dx = 2 c sum(c).
    x = randn(3, 4)
    (c,) = hg.autograd.grad(SECOND_BACKWARD_RAISES[name](x), x)
    (g,) = hg.autograd.grad(SECOND_BACKWARD_RAISES[name](x) ** 2, x, create_graph=True)
    (gg,) = hg.autograd.grad(g.sum(), x)
    assert_close(gg, 2 * c.array * c.array.sum())
