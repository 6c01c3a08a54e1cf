"""Ports of PyTorch's DistOptimizerTest (dist_optimizer_test.py): DistributedOptimizer over RRefs.

Every rank runs each test at once; its two parameter owners are ranks + 1 and + 2 (the same
rank at 2 ranks). Left out:
- Adagrad, Adadelta, RMSprop, Adamax, Rprop in test_dist_optim: hpcgrad has SGD, Adam, AdamW.
- test_dist_optim_none_grads: it relies on torch's seeded generator drawing a parameter that
  does not require grad on the owner.
"""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad.distributed.optim import DistributedOptimizer

import rpc_conformance_helpers as h
from rpc_conformance_helpers import WAIT, rpc_step, rpc_worker  # noqa: F401  (fixtures)

pytestmark = pytest.mark.mpi(min_size=2)


def remote_params():
    rank, size = h.rank_and_size()
    owner1, owner2 = h.worker_name((rank + 1) % size), h.worker_name((rank + 2) % size)
    module1 = rpc.remote(owner1, h.MyModule, timeout=WAIT)
    module2 = rpc.remote(owner2, h.MyModule, timeout=WAIT)
    return module1, module2, [h.remote_method(h.MyModule.get_w, module1),
                              h.remote_method(h.MyModule.get_w, module2)]


def inputs():
    rng = np.random.default_rng(0)
    return (hg.tensor(rng.random((3, 3)).astype(np.float32), requires_grad=True),
            hg.tensor(rng.random((3, 3)).astype(np.float32), requires_grad=True))


def forward(module1, module2):
    t1, t2 = inputs()
    output1 = h.rpc_async_method(h.MyModule.forward, module1, t2)
    output2 = h.rpc_async_method(h.MyModule.forward, module2, output1.wait(WAIT))
    return hg.add(output2.wait(WAIT), t1).sum()


def test_dist_optim_exception():
    module1, module2, params = remote_params()
    dist_optim = DistributedOptimizer(h.FailingOptimizer, params)
    with dist_autograd.context() as context_id:
        h.backward(context_id, [forward(module1, module2)])
        with pytest.raises(Exception, match="Error running optimizer"):
            dist_optim.step(context_id)


def test_dist_optim_exception_on_constructor():
    _, _, params = remote_params()
    with pytest.raises(Exception, match="Error creating optimizer."):
        DistributedOptimizer(h.OptimizerFailingOnConstructor, params)


def check_dist_optim(optim_cls, **kwargs):
    """The same two-module model stepped locally and by DistributedOptimizer on the owners."""
    local1, local2 = h.MyModule(), h.MyModule()
    local_optim = optim_cls([local1.get_w(), local2.get_w()], **kwargs)
    old_w1, old_w2 = local1.w.array.copy(), local2.w.array.copy()
    t1, t2 = inputs()
    hg.add(local2.forward(local1.forward(t2)), t1).sum().backward()
    local_optim.step()

    module1, module2, params = remote_params()
    h.assert_close(params[0].to_here(WAIT), old_w1)
    h.assert_close(params[1].to_here(WAIT), old_w2)
    dist_optim = DistributedOptimizer(optim_cls, params, **kwargs)
    with dist_autograd.context() as context_id:
        h.backward(context_id, [forward(module1, module2)])
        dist_optim.step(context_id)
        new_w1 = h.rpc_async_method(h.MyModule.get_w, module1).wait(WAIT)
        new_w2 = h.rpc_async_method(h.MyModule.get_w, module2).wait(WAIT)
    assert not np.array_equal(new_w1.array, old_w1)
    assert not np.array_equal(new_w2.array, old_w2)
    h.assert_close(new_w1, local1.get_w())
    h.assert_close(new_w2, local2.get_w())


@pytest.mark.parametrize("optim_cls, kwargs", [
    (hg.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (hg.optim.AdamW, dict(lr=0.05, amsgrad=True)),
    (hg.optim.SGD, dict(lr=0.05)),
    (hg.optim.SGD, dict(lr=1e-3, momentum=1, weight_decay=1, nesterov=True)),
], ids=["Adam", "AdamW", "SGD", "SGD-nesterov"])
def test_dist_optim(optim_cls, kwargs):
    check_dist_optim(optim_cls, **kwargs)
