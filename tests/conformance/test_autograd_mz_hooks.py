"""Ports of PyTorch's TestAutograd hook tests (test_m*..test_z*): post-accumulate, pre-hooks, retain_grad.

PyTorch's hooks change leaves with in-place ops (``tensor.sub_``, ``grad.add_``); hpcgrad has
none, so these ports change the arrays in place (``tensor.data -= ...``), as an optimizer does.
Left out (hpcgrad does not build them): hooks across in-place ops and views
(test_retain_grad_inplace*, test_retains_grad_inplace_multiple_outputs, test_tensor_hooks_inplace*),
register_multi_grad_hook (test_multi_grad_*), torch._C._current_autograd_node
(test_node_post_hook_registered_during_unpack_hook).
"""

import copy
import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad

import autograd_mz_helpers as m

close = m.h.assert_close


def _sub_grad(tensor):
    tensor.array -= tensor.grad.array  # tensor.sub_(tensor.grad)


def test_post_accumulate_grad_hook_on_non_leaf():
    leaf = m.rand(3, requires_grad=True)
    non_leaf = 2.0 * leaf
    with pytest.raises(RuntimeError,
                       match="post accumulate grad hooks cannot be registered on non-leaf tensors"):
        non_leaf.register_post_accumulate_grad_hook(lambda t: None)


def test_post_accumulate_grad_hook_multiple_hooks():
    def hook2(tensor):
        tensor.array *= 4.0  # tensor.mul_(4.0)

    tensor = m.rand(3, requires_grad=True)
    tensor_ref = m.h.arr(tensor).copy()
    tensor.register_post_accumulate_grad_hook(_sub_grad)
    tensor.register_post_accumulate_grad_hook(hook2)
    tensor.sum().backward()
    close(tensor, 4.0 * (tensor_ref - 1.0))  # both hooks ran, in order


def test_post_accumulate_grad_hook_multiple_tensors():
    tensor1 = m.rand(3, requires_grad=True)
    tensor2 = m.rand(5, requires_grad=True, seed=1)
    ref1, ref2 = m.h.arr(tensor1).copy(), m.h.arr(tensor2).copy()
    tensor1.register_post_accumulate_grad_hook(_sub_grad)
    tensor2.register_post_accumulate_grad_hook(_sub_grad)
    tensor1.sum().backward()
    tensor2.sum().backward()
    close(tensor1, ref1 - 1.0)
    close(tensor2, ref2 - 1.0)


def test_post_accumulate_grad_hook_returns_not_None():
    tensor = m.rand(2, 3, requires_grad=True)
    tensor.register_post_accumulate_grad_hook(lambda t: t.grad)
    with pytest.raises(RuntimeError, match="hooks should return None."):
        tensor.sum().backward()


def test_post_accumulate_grad_hook_e2e():
    # An optimizer step per parameter inside backward gives the same parameters as the usual
    # step after backward; removing the hooks stops the updates.
    def setup_optim_in_bwd(model):
        optims, handles = {}, []

        def optim_step_hook(param):
            optims[param].step()
            optims[param].zero_grad()

        for p in model.parameters():
            optims[p] = hg.optim.Adam([p])
            handles.append(p.register_post_accumulate_grad_hook(optim_step_hook))
        return handles

    hg.manual_seed(0)
    model = hg.nn.Linear(3, 2)
    inp = m.rand(2, 3).float()
    handles = setup_optim_in_bwd(model)
    model_copy = copy.deepcopy(model)
    optim_copy = hg.optim.Adam(model_copy.parameters())

    def run(iters):
        for _ in range(iters):
            model(inp).sum().backward()
            model_copy(inp).sum().backward()
            optim_copy.step()
            optim_copy.zero_grad()

    run(5)
    frozen = []
    for p_reference, p in zip(model_copy.parameters(), model.parameters()):
        close(p, p_reference, rtol=1e-6, atol=1e-6)
        frozen.append(m.h.arr(p_reference).copy())

    for handle in handles:
        handle.remove()
    run(5)
    for p_static, p_reference, p in zip(frozen, model_copy.parameters(), model.parameters()):
        close(p, p_static)
        assert not np.allclose(m.h.arr(p_reference), m.h.arr(p))


def test_post_accumulate_grad_hook_gets_cleaned_up():
    def fun_stuff_with_hook():
        thing_to_put_in_hook = m.rand(3, seed=1)

        def hook(tensor):
            tensor.array -= tensor.grad.array
            tensor.array += thing_to_put_in_hook.array

        tensor = m.rand(3, requires_grad=True)
        tensor.register_post_accumulate_grad_hook(hook)
        tensor.sum().backward()
        ref = weakref.ref(thing_to_put_in_hook)
        gc.collect()
        return tensor, ref

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tensor, ref = fun_stuff_with_hook()
        assert ref() is not None  # kept alive by the tensor's hook
        del tensor
        gc.collect()
        assert ref() is None  # ... and freed with it
    finally:
        if was_enabled:
            gc.enable()


def test_post_accumulate_grad_hook_ordering():
    tensor = m.rand(3, requires_grad=True)

    def pre_hook(grad):
        return grad - 2.0

    def acc_grad_node_pre_hook(grad_out):
        return (grad_out[0] / 5.0,)

    def post_acc_grad_hook(tensor):
        tensor.grad.array += 0.5  # tensor.grad.add_(0.5)

    def acc_grad_node_post_hook(grad_in, grad_out):
        tensor.grad = grad_out[0] * 10

    acc_grad = m.accumulate_grad_node(tensor)
    tensor.register_hook(pre_hook)
    acc_grad.register_prehook(acc_grad_node_pre_hook)
    tensor.register_post_accumulate_grad_hook(post_acc_grad_hook)
    acc_grad.register_hook(acc_grad_node_post_hook)
    tensor.sum().backward()
    # Order: tensor pre-hook, Node pre-hook, post-accumulate hook, Node post-hook:
    # ((1 - 2) / 5 + 0.5) * 10 = 3
    close(tensor.grad, [3.0, 3.0, 3.0])


def test_prehook_ordering():
    # Hooks registered on a tensor run before those registered on its grad_fn.
    log = []

    def hook1(g):
        log.append(1)
        return g * 3

    def hook2(gs):
        log.append(2)
        return tuple(g * 2 for g in gs)

    a = m.t(1.0, requires_grad=True)
    b = a.clone()
    b.grad_fn.register_prehook(hook2)
    b.register_hook(hook1)
    b.grad_fn.register_prehook(hook2)

    acc = b.grad_fn.next_functions[0][0]
    a.register_hook(hook1)
    acc.register_prehook(hook2)
    a.register_hook(hook1)

    b.sum().backward(retain_graph=True)
    assert log == [1, 2, 2, 1, 1, 2]

    # grad() runs the tensor hooks of an AccumulateGrad it captures at, though not the Node.
    log.clear()
    grad(b.sum(), inputs=(a,), retain_graph=True)
    assert log == [1, 2, 2, 1, 1]

    log.clear()
    b.sum().backward(inputs=(b,))
    assert log == [1, 2, 2]
    # The retains_grad hook runs after the tensor hooks but sees none of the Node pre-hooks.
    assert b.grad.item() == 3


def test_retains_grad_can_always_observe_tensor_prehook():
    def tensor_prehook(g):
        return g * 2

    a = m.t(1.0, requires_grad=True)
    b = a.clone()
    b.register_hook(tensor_prehook)
    b.retain_grad()
    b.register_hook(tensor_prehook)
    b.clone().backward()
    assert b.grad.item() == 4  # registered after retain_grad, still observed

    a = m.t(1.0, requires_grad=True)
    b = a.clone()
    b.retain_grad()
    b.register_hook(tensor_prehook)
    b.clone().backward()
    assert b.grad.item() == 2


def test_retain_grad():
    inp = m.rand(1, 3, requires_grad=True)
    h1 = inp * 3
    out = (h1 * h1).sum()

    h1.retain_grad()  # more than once is fine
    h1.retain_grad()

    out.backward(retain_graph=True)
    close(h1.grad, m.h.arr(h1) * 2)
    out.backward(retain_graph=True)  # accumulates
    close(h1.grad, m.h.arr(h1) * 4)

    inp.grad.zero_()
    inp.retain_grad()  # a no-op for leaves
    inp.retain_grad()
    out.backward()
    close(inp.grad, m.h.arr(inp) * 18)


def test_retain_grad_cycle():
    x = m.ones(5, 5, requires_grad=True)

    def run_test():
        y = x * 2
        y.retain_grad()
        return y / 2, weakref.ref(y)

    z, ref = run_test()
    assert ref() is None  # neither y / 2 nor the retain_grad hook keeps y alive
    z.sum().backward()
