"""Ports of PyTorch's TestAutograd checkpoint and saved-tensor-hook tests (test_a*..test_l*).

``hpcgrad.utils.checkpoint.checkpoint`` (reentrant and ``use_reentrant=False``) and
``hpcgrad.autograd.graph.saved_tensors_hooks`` / ``disable_saved_tensors_hooks``.
Left out (hpcgrad does not build them): context_fn and TorchDispatchMode
(test_checkpointing_without_reentrant_with_context_fn), checkpoint_sequential, GraphExecGroup
(test_checkpoint_graph_execution_group), autocast (test_checkpointing_non_reentrant_autocast_*),
checkpoint's debug mode and set_checkpoint_early_stop (those parts of
test_checkpoint_detects_non_determinism), DataParallel (..._dataparallel), CUDA memory and
devices (test_checkpoint_compile_no_recompile, test_checkpoint_device_context_fn,
test_checkpointing_without_reentrant_memory_savings), private saved-variable accessors
(test_access_saved_tensor_twice_without_recomputation_works,
test_get_data_and_hooks_from_raw_saved_variable), save_on_cpu (test_graph_save_on_cpu).
"""

import copy
import gc
import warnings
import weakref

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import nn
from hpcgrad.autograd import Function, grad
from hpcgrad.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks

import autograd_al_helpers as a

close = a.close
arr = a.arr
checkpoint = a.checkpoint


def _proxy_network(nz_inp=10, nz_bottleneck=100):
    """PyTorch's Linear(10, 1000) -> ReLU -> Linear(1000, 10), narrower to keep the test fast."""
    hg.manual_seed(0)
    return nn.Sequential(nn.Linear(nz_inp, nz_bottleneck), nn.ReLU(),
                         nn.Linear(nz_bottleneck, nz_inp)).double()


def _checkpointed_matches_plain(use_reentrant, input_requires_grad, num_inp=20):
    """Gradients of a per-input checkpointed block equal those of the same block without it."""
    module = _proxy_network()
    module_copy = copy.deepcopy(module)
    rng = np.random.default_rng(0)
    feat, feat_plain = [], []
    for _ in range(num_inp):
        data = a.t(rng.random((1, 10)), requires_grad=input_requires_grad)
        feat.append(checkpoint(module, data, use_reentrant=use_reentrant))
        feat_plain.append(module_copy(data))
    hg.stack(feat).mean().backward()
    hg.stack(feat_plain).mean().backward()
    for p, q in zip(module.parameters(), module_copy.parameters()):
        assert p.grad is not None
        close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_checkpointing():
    # PyTorch runs 2000 inputs through a 1000-wide bottleneck and only checks that backward
    # runs; here fewer, narrower, and compared with the block run without checkpointing.
    _checkpointed_matches_plain(use_reentrant=True, input_requires_grad=True)


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_checkpointing_without_reentrant(input_requires_grad):
    _checkpointed_matches_plain(use_reentrant=False, input_requires_grad=input_requires_grad)


def test_checkpointing_without_reentrant_correct_grad():
    x = a.randn(2, 2, requires_grad=True)
    x.exp().sum().backward()
    b_grad = x.grad
    x.grad = None
    checkpoint(hg.exp, x, use_reentrant=False).sum().backward()
    c_grad = x.grad
    x.grad = None
    d_grad, = grad(checkpoint(hg.exp, x, use_reentrant=False).sum(), (x,))
    close(b_grad, c_grad)
    close(b_grad, d_grad)


def test_checkpointing_without_reentrant_custom_function_works():
    msg = "Unpack is being triggered for a tensor that was already unpacked once"

    class MyFunc(Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, w, out = ctx.saved_tensors
            # recomputed tensors are cleared once unpacked: a second access raises
            with pytest.raises(RuntimeError, match=msg):
                ctx.saved_tensors
            return x, y, z

    x = a.t(1.0, requires_grad=True)
    y = a.t(2.0, requires_grad=True)
    z = a.t(3.0, requires_grad=True)

    def foo(x, y, z):
        x = x * y * z
        y = y * y * z
        z = z * z
        return MyFunc.apply(x, y, z)

    checkpoint(foo, x, y, z, use_reentrant=False).sum().backward()


def test_checkpoint_warns_if_use_reentrant_not_passed_explcitly():
    x = a.randn(1, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # passing it explicitly does not warn
        checkpoint(lambda t: t * 1, x, use_reentrant=False)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly"):
        checkpoint(lambda t: t * 1, x)


def _non_det_fn(orig_fn, recompute_fn):
    """orig_fn on the first (forward) call, recompute_fn on the recomputation."""
    counter = [0]

    def fn(x):
        if counter[0] == 0:
            counter[0] += 1
            return orig_fn(x)
        return recompute_fn(x)

    return fn


# PyTorch's x.sin().exp() (2 saved tensors) and x.sin().exp().sin() (3), with tanh for sin.
def _save_3_tensors(x):
    return x.tanh().exp().tanh()


def _save_2_tensors(x):
    return x.tanh().exp()


def _save_2_tensors_alt(x):
    return x.tanh() * hg.tensor(np.array([1.0, 2.0]))


def test_checkpoint_detects_non_determinism():
    x = a.randn(1, requires_grad=True)
    # fewer tensors saved during the recomputation
    fn = _non_det_fn(orig_fn=_save_3_tensors, recompute_fn=_save_2_tensors)
    with pytest.raises(RuntimeError, match="(?i)A different number of tensors was saved"):
        checkpoint(fn, x, use_reentrant=False).backward()


def test_checkpoint_detects_non_determinism_early_stop():
    x = a.randn(1, requires_grad=True)
    fn = _non_det_fn(orig_fn=_save_2_tensors, recompute_fn=_save_3_tensors)
    checkpoint(fn, x, use_reentrant=False).backward()
    close(x.grad, (1 - np.tanh(arr(x)) ** 2) * np.exp(np.tanh(arr(x))))


def test_checkpoint_detects_non_determinism_metadata():
    x = a.randn(1, requires_grad=True)
    # the same number of tensors, but of another shape: PyTorch refuses it
    fn = _non_det_fn(orig_fn=_save_2_tensors, recompute_fn=_save_2_tensors_alt)
    with pytest.raises(RuntimeError, match="tensors have different metadata"):
        checkpoint(fn, x, use_reentrant=False).backward()


def test_checkpoint_valid_reset_on_error():
    x = a.randn(2, 2, requires_grad=True)
    with pytest.raises(Exception, match="(?i)checkpoint.* (is )?(in|not )compatible"):
        b = checkpoint(hg.exp, x, use_reentrant=True).sum()
        grad(b, (x,))
    # the failed grad() does not leave checkpointing refused afterwards
    c = checkpoint(hg.exp, x, use_reentrant=True).sum()
    c.backward()
    close(x.grad, np.exp(arr(x)))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_without_reentrant_detached_tensor(use_reentrant):
    class NoGradModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False).double()
            self.lin2 = nn.Linear(2, 2, bias=False).double()

        def forward(self, x):
            with hg.no_grad():
                return self.lin2(self.linear(x))

    module = NoGradModule()
    x = a.randn(2, 2, requires_grad=True)
    for _ in range(3):
        out = checkpoint(module, x, use_reentrant=use_reentrant)  # does not require grad
        out = out + x  # (PyTorch: out += a) so that the loss requires grad
        if use_reentrant:
            # PyTorch: "none of output has requires_grad=True, this checkpoint() is not necessary"
            with pytest.raises(RuntimeError, match="none of (the )?outputs? ha"):
                out.sum().backward()
        else:
            out.sum().backward()


def test_checkpointing_without_reentrant_saved_object_identity():
    x_backward = None

    class Test(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, x):
            nonlocal x_backward
            x_backward, = ctx.saved_tensors
            return x, None

    x = a.t(1.0, requires_grad=True)
    y = a.t(1.0)
    Test.apply(x, y).backward()
    assert x_backward is y
    x_backward = None
    checkpoint(Test.apply, x, y, use_reentrant=False).backward()
    assert x_backward is y


def test_checkpointing_without_reentrant_parameter_used_in_an_out():
    # a hook on a parameter used inside and outside the checkpoint runs once
    w = a.randn(10, 10, requires_grad=True)
    count = [0]

    def hook(grad):
        count[0] += 1

    w.register_hook(hook)
    x = a.rand(10, 10, requires_grad=True)
    h = w * x  # w outside the checkpoint
    out = checkpoint(lambda t: w * t, h, use_reentrant=False)  # and inside
    out.sum().backward()
    assert count[0] == 1


def test_checkpointing_without_reentrant_arbitrary_input_output():
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5, bias=False).double()

        def forward(self, dict_input):
            return {"result": self.layer(dict_input["tensor"])}

    model_no_checkpoint = MyModel()
    model_checkpoint = copy.deepcopy(model_no_checkpoint)
    inp = {"tensor": a.randn(5, 5)}
    out_no_checkpoint = model_no_checkpoint(inp)["result"].sum()
    out_checkpoint = checkpoint(model_checkpoint, inp, use_reentrant=False)["result"].sum()
    close(out_checkpoint, out_no_checkpoint)
    out_no_checkpoint.backward()
    out_checkpoint.backward()
    for p, q in zip(model_no_checkpoint.parameters(), model_checkpoint.parameters()):
        close(p.grad, q.grad)


def test_custom_autograd_ac_early_stop():
    # what the non-reentrant recomputation saves is freed by the backward that used it
    refs = []

    class Test(Function):
        @staticmethod
        def forward(ctx, x):
            y = x.clone()
            ctx.save_for_backward(y)
            refs.append(weakref.ref(y))
            return y

        @staticmethod
        def backward(ctx, *args):
            ctx.saved_tensors
            return None

    inp = a.randn(5, 5, requires_grad=True)

    def scope():
        out = checkpoint(Test.apply, inp, use_reentrant=False)
        out.sum().backward()

    gc.disable()
    try:
        scope()
        assert refs and all(ref() is None for ref in refs)
    finally:
        gc.enable()


# --- saved-tensor hooks -------------------------------------------------------------------------

@pytest.mark.parametrize("hooked", [
    "none",
    "forward",
    "backward",
    "both"])
def test_default_saved_tensors_hooks_double_backward(hooked):
    # "none": identity hooks around everything. Otherwise hooks doubling every saved tensor
    # around the forward, around grad(create_graph=True) and the second backward, or both.
    # y = x ** 3: the forward saves x once (factor 2); the backward, grad * (3 * x.pow(2)) in
    # PyTorch and in hpcgrad's Pow (checked by hand), saves grad and x (factor 4); both: 8.
    factor = {"none": 1, "forward": 2, "backward": 4, "both": 8}[hooked]
    identity = saved_tensors_hooks(lambda t: t, lambda t: t)
    doubling = saved_tensors_hooks(lambda t: 2 * t, lambda t: t)
    forward_hooks = doubling if hooked in ("forward", "both") else identity
    backward_hooks = doubling if hooked in ("backward", "both") else identity
    x = a.randn(5, requires_grad=True)
    with forward_hooks:
        s = (x ** 3).sum()
    with backward_hooks:
        g, = grad(s, (x,), create_graph=True)
        g.sum().backward()
    close(x.grad, 6 * factor * arr(x))


def test_disabling_saved_tensor_hooks():
    with disable_saved_tensors_hooks("error message"):
        with pytest.raises(RuntimeError, match="error message"):
            with saved_tensors_hooks(lambda x: x, lambda x: x):
                pass
    with saved_tensors_hooks(lambda x: x, lambda x: x):  # enabled again afterwards
        pass


def test_disabling_saved_tensor_hooks_while_hooks_are_active():
    # the second half of PyTorch's test_disabling_saved_tensor_hooks
    with saved_tensors_hooks(lambda x: x, lambda x: x):
        with pytest.raises(RuntimeError, match="error message"):
            with disable_saved_tensors_hooks("error message"):
                pass
    with saved_tensors_hooks(lambda x: x, lambda x: x):
        pass


def test_disabling_saved_tensor_hooks_nested():
    with disable_saved_tensors_hooks("outer"):
        with disable_saved_tensors_hooks("inner"):
            with pytest.raises(RuntimeError, match="inner"):
                with saved_tensors_hooks(lambda x: x, lambda x: x):
                    pass
        # leaving the inner one keeps the outer one in force
        with pytest.raises(RuntimeError, match="outer"):
            with saved_tensors_hooks(lambda x: x, lambda x: x):
                pass
    with saved_tensors_hooks(lambda x: x, lambda x: x):
        pass
