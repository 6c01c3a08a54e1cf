"""Distributed autograd with tensors on numpy and on cupy: gradients equal one process's.

Rank 0 sends a tensor on the chosen module to the other ranks by rpc_sync; they compute on
the same module with weights they own and send the result back; rank 0 finishes the loss on
its module and runs the distributed backward. Every gradient in the context (rank 0's and the
owners') must equal the plain backward of the same computation in one process, and live on
the tensor's own device.

The functions called remotely are defined here at module level: every rank imports this module
under the same name, so the callee unpickles them by reference (as rpc_cases.py's).
"""

import threading

import numpy as np
import pytest
from arrays import xp_fixture  # noqa: F401  (the xp fixture)
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker, seeded  # noqa: F401

import hpcgrad.distributed.autograd as dist_autograd
from hpcgrad import backend
from hpcgrad.distributed import rpc
from hpcgrad.tensor import Tensor

TOL = 1e-10  # float64; cuBLAS and numpy may sum in different orders

_weights = {}  # (module name, weight name) -> this rank's weight Tensor
_weights_lock = threading.Lock()


def device_for(module_name):
    """The device this rank uses for ``module_name``, as tests/arrays.py chooses it."""
    if module_name == "numpy":
        return backend.CPU
    rank, _ = rank_and_size()
    return f"cuda:{rank % backend.device_count()}"


def weight(module_name, name, registry):
    """Weight ``name`` on the module's device, from rpc_cases' seed for that name."""
    key = (module_name, name)
    with _weights_lock:
        if key not in registry:
            host = seeded(name)
            registry[key] = Tensor(backend.to_device(host, device_for(module_name)),
                                   requires_grad=True)
        return registry[key]


# --- run on the remote rank ------------------------------------------------------------------
def stage(h, name, module_name, registry=_weights):
    """tanh(h @ W[name]) on the module's device; ``h`` may arrive on the host (RPC sends host
    copies), so it is moved there first: a differentiable move."""
    h = h.to(device_for(module_name))
    return (h @ weight(module_name, name, registry)).tanh()


def two_outputs(h, name, module_name):
    """(stage, its square): the caller uses only the first, so the second's gradient is zeros."""
    y = stage(h, name, module_name)
    return y, y * y


def context_grads(context_id, module_name):
    """{weight name: (host gradient, device of the gradient, .grad is None)} for this rank."""
    grads = dist_autograd.get_gradients(context_id)
    with _weights_lock:
        owned = {name: w for (m, name), w in _weights.items() if m == module_name}
    return {name: (backend.to_device(grads[w].array, backend.CPU), backend.device_of(grads[w].array),
                   w.grad is None) for name, w in owned.items() if w in grads}


# --- the model, run across ranks (registry "rpc") or in one process (a local dict) -------------
def model(x, size, module_name, registry):
    """x -> rank 1's stage -> (times x) -> the last rank's stage -> rank 0's weight -> loss."""
    device = device_for(module_name)

    def remote(rank, *args):
        if registry == "rpc":
            return rpc.rpc_sync(rank, stage, args=args, timeout=WAIT_LIMIT).to(device)
        return stage(*args, registry=registry)

    h = remote(1, x, "g1a", module_name)
    h = remote(size - 1, h * x, f"g{size - 1}b", module_name)
    local = _weights if registry == "rpc" else registry
    out = h @ weight(module_name, "g0", local)
    return (out * out).sum()


def driver():
    return rank_and_size()[0] == 0


def remote_gradients(ctx, size, module_name):
    out = {}
    for r in range(1, size):
        out.update(rpc.rpc_sync(r, context_grads, args=(ctx, module_name), timeout=WAIT_LIMIT))
    return out


@pytest.mark.mpi(min_size=2)
def test_gradients_match_one_process(xp):
    if not driver():
        return
    _, size = rank_and_size()
    x_data = np.random.default_rng(3).standard_normal((3, 5))
    x = xp.tensor(x_data, requires_grad=True)
    with dist_autograd.context() as ctx:
        loss = model(x, size, xp.name, "rpc")
        dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
        got = dist_autograd.get_gradients(ctx)
        remote = remote_gradients(ctx, size, xp.name)

    reference = {}
    x_ref = xp.tensor(x_data, requires_grad=True)
    ref_loss = model(x_ref, size, xp.name, reference)
    ref_loss.backward()
    np.testing.assert_allclose(xp.numpy(loss), xp.numpy(ref_loss), rtol=1e-12)

    assert x.grad is None, "distributed backward must leave .grad alone"
    np.testing.assert_allclose(xp.numpy(got[x]), xp.numpy(x_ref.grad), rtol=0, atol=TOL)
    w0 = _weights[(xp.name, "g0")]
    np.testing.assert_allclose(xp.numpy(got[w0]), xp.numpy(reference[(xp.name, "g0")].grad),
                               rtol=0, atol=TOL)
    expected = {name for (_, name) in reference} - {"g0"}
    assert set(remote) == expected, (sorted(remote), sorted(expected))
    for name, (grad, device, untouched) in remote.items():
        assert untouched, f"{name}.grad was set by a distributed backward"
        assert device.split(":")[0] == xp.device.split(":")[0], f"{name}'s gradient on {device}"
        np.testing.assert_allclose(grad, xp.numpy(reference[(xp.name, name)].grad), rtol=0,
                                   atol=TOL, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_unused_returned_tensor_gets_a_zero_gradient(xp):
    """Of two tensors sent back in one message only one is used: backward still completes, and
    the remote weight's gradient is that of the used one alone."""
    if not driver():
        return
    x_data = np.random.default_rng(4).standard_normal((2, 5))
    x = xp.tensor(x_data, requires_grad=True)
    with dist_autograd.context() as ctx:
        used, _unused = rpc.rpc_sync(1, two_outputs, args=(x, "u1", xp.name), timeout=WAIT_LIMIT)
        loss = used.to(xp.device).sum()
        dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
        got = dist_autograd.get_gradients(ctx)
        remote = rpc.rpc_sync(1, context_grads, args=(ctx, xp.name), timeout=WAIT_LIMIT)

    reference = {}
    x_ref = xp.tensor(x_data, requires_grad=True)
    stage(x_ref, "u1", xp.name, registry=reference).sum().backward()
    np.testing.assert_allclose(xp.numpy(got[x]), xp.numpy(x_ref.grad), rtol=0, atol=TOL)
    grad, _, _ = remote["u1"]
    np.testing.assert_allclose(grad, xp.numpy(reference[(xp.name, "u1")].grad), rtol=0, atol=TOL)
