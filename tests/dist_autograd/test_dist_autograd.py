"""Distributed autograd: gradients across ranks equal one process's; errors, timeouts, concurrency.

Each model runs from rank 0 through the other ranks (tests/rpc_cases.py) and again
in one process on rank 0 with the same seeded weights; every rank's gradients in the context
must match the reference, and ``.grad`` must stay None.
"""

import time

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


def driver():
    return rank_and_size()[0] == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("model", ["fan", "twice"])
def test_gradients_match_one_process(model):
    if driver():
        cases.check_model(cases.MODELS[model])


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("model", ["chain", "nested"])
def test_gradients_match_one_process_3_ranks(model):
    if driver():
        cases.check_model(cases.MODELS[model])


@pytest.mark.mpi(min_size=2)
def test_spmd_send_recv_pipeline():
    cases.check_pipeline()


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_equals_local_sgd():
    if driver():
        cases.check_optimizer()


@pytest.mark.mpi(min_size=2)
def test_error_in_remote_backward_names_the_node():
    if driver():
        check_error_in_remote_backward(nested=False)


@pytest.mark.mpi(min_size=3)
def test_error_in_nested_remote_backward_names_the_node():
    if driver():
        check_error_in_remote_backward(nested=True)


def check_error_in_remote_backward(nested):
    """The failing rank is named in the error; afterwards a fresh context works again."""
    _, size = rank_and_size()
    failing = 2 if nested else size - 1
    x = hg.tensor(np.ones((2, cases.FEATURES)), requires_grad=True)
    with dist_autograd.context() as ctx:
        if nested:
            y = rpc.rpc_sync(1, cases.fail_via, args=(x, failing))
        else:
            y = rpc.rpc_sync(failing, cases.fail_in_backward, args=(x,))
        with pytest.raises(RuntimeError, match=rf"Error on Node {failing}: .*deliberate failure"):
            dist_autograd.backward(ctx, [y.sum()], timeout=WAIT_LIMIT)
    cases.wait_until_idle(range(size))
    cases.check_model(cases.fan_out_in)  # a fresh context works


@pytest.mark.mpi(min_size=2)
def test_backward_timeout_is_a_clear_error():
    if not driver():
        return
    _, size = rank_and_size()
    rpc.rpc_sync(1, cases.reset_wake)
    x = hg.tensor(np.ones((2, cases.FEATURES)), requires_grad=True)
    start = time.monotonic()
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(1, cases.stall_in_backward, args=(x,))
        with pytest.raises(TimeoutError, match=r"backward.*rank 1.*timed out after 0.5 s"):
            dist_autograd.backward(ctx, [y.sum()], timeout=0.5)
    assert time.monotonic() - start < 3
    rpc.rpc_sync(1, cases.wake)
    cases.wait_until_idle(range(size))
    cases.check_model(cases.fan_out_in)  # a fresh context works


@pytest.mark.mpi(min_size=2)
def test_concurrent_contexts_from_threads():
    """5 threads x 10 contexts, each with its own input: separate, correct gradients; nothing
    is left behind on any rank afterwards."""
    if not driver():
        return
    _, size = rank_and_size()
    grads = cases.run_in_threads(5, 10, lambda i: cases.check_model(cases.fan_out_in, i, False))
    assert len(grads) == 50
    assert len({g.tobytes() for g in grads.values()}) == 50
    states = cases.wait_until_idle(range(size))
    assert set(states) == set(range(size))


ROOTS = {
    "not-scalar": (lambda: [hg.tensor([1.0, 2.0, 3.0], requires_grad=True) * 2.0],
                   r"root 0 \(shape \[3\]\) is not a scalar, all roots need to be scalar"),
    "leaf": (lambda: [hg.tensor([2.0], requires_grad=True)],
             "root 0 does not have a valid gradient function"),
    "no-requires-grad": (lambda: [hg.tensor([1.0])], "requires_grad not set on root 0"),
    "empty": (lambda: [], "No tensors provided for gradient computation"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", ROOTS)
def test_root_validation(case):
    make_roots, message = ROOTS[case]
    with dist_autograd.context() as ctx:
        with pytest.raises(RuntimeError, match=message):
            dist_autograd.backward(ctx, make_roots())
        assert dist_autograd._get_debug_info()["num_current_backward_passes"] == 0


# --- Note [Stolen gradients] (distributed/autograd/engine.py) ------------------------------------
# The context keeps a leaf's gradient by reference when nothing else can see it; these are the
# cases where something can, each on every rank's own local pass: the context's gradient must
# then be a copy (equal values, its own memory), and none is ever written to afterwards.

def _shared(a, b):
    return np.shares_memory(np.asarray(a.array), np.asarray(b.array))


@pytest.mark.mpi
def test_context_copies_a_gradient_a_leaf_hook_kept():
    w = hg.tensor(np.arange(4.0), requires_grad=True)
    kept = []
    w.register_hook(lambda g: kept.append(g))
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [(w * w).sum()])
        grad = dist_autograd.get_gradients(ctx)[w]
    np.testing.assert_array_equal(grad.array, 2 * np.arange(4.0))
    assert len(kept) == 1 and not _shared(grad, kept[0])
    kept[0].array[...] = -1.0  # the hook's owner writes to what it kept
    np.testing.assert_array_equal(grad.array, 2 * np.arange(4.0))


@pytest.mark.mpi
def test_context_copies_a_gradient_shared_by_two_leaves_and_a_hook():
    w = hg.tensor(np.arange(3.0), requires_grad=True)
    b = hg.tensor(np.ones(3), requires_grad=True)
    kept = []
    y = w + b  # AddBackward hands one gradient Tensor to both leaves
    y.register_hook(lambda g: kept.append(g))
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [(y * y).sum()])
        grads = dist_autograd.get_gradients(ctx)
    expected = 2 * (np.arange(3.0) + 1)
    np.testing.assert_array_equal(grads[w].array, expected)
    np.testing.assert_array_equal(grads[b].array, expected)
    assert not _shared(grads[w], grads[b])
    assert not _shared(grads[w], kept[0]) and not _shared(grads[b], kept[0])


@pytest.mark.mpi
def test_context_copies_a_gradient_a_node_pre_hook_saw():
    w = hg.tensor(np.arange(4.0), requires_grad=True)
    y = w * w
    accumulator = y.grad_fn.next_functions[0][0]
    kept = []
    accumulator.register_prehook(lambda grads: kept.append(grads[0]))
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [y.sum()])
        grad = dist_autograd.get_gradients(ctx)[w]
    np.testing.assert_array_equal(grad.array, 2 * np.arange(4.0))
    assert len(kept) == 1 and not _shared(grad, kept[0])


@pytest.mark.mpi
def test_context_gradient_returned_earlier_is_not_written_by_a_later_pass():
    w = hg.tensor(np.arange(4.0), requires_grad=True)
    y = (w * w).sum()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [y], retain_graph=True)
        first = dist_autograd.get_gradients(ctx)[w]
        dist_autograd.backward(ctx, [y])
        total = dist_autograd.get_gradients(ctx)[w]
    np.testing.assert_array_equal(first.array, 2 * np.arange(4.0))  # kept (stolen) as it was
    np.testing.assert_array_equal(total.array, 4 * np.arange(4.0))
    assert w.grad is None  # never .grad
