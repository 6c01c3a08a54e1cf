"""Ports of PyTorch's DistAutogradTest (dist_autograd_test.py): contexts, graphs, cleanup.

Every rank runs each test at once, calling its ring peers, as PyTorch's do (2, 3 and 4 ranks).
The backward tests are in test_dist_autograd_pytorch_backward.py. Left out of both modules:
- test_dist_autograd_profiling: the profiler.
- test_backward_simple_script_call, test_trainer_ps_torchscript_functions: TorchScript.
- the *_sparse variants, test_no_grad_copy_sparse, test_grad_copy_sparse_indices_extra_ref:
  sparse COO tensors; test_embedding_bag_with_no_grad_tensors: EmbeddingBag (not built).
- test_backward_node_failure(_python_udf): they kill ranks (faulty-agent tests).
- test_clean_context_during_backward: PyTorch's own test ends its processes, peers stay stuck.
- CudaDistAutogradTest, TensorPipeCudaDistAutogradTest: CUDA and device maps.
- FaultyAgentDistAutogradTest: the faulty agent.
"""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc

import rpc_conformance_helpers as h
from rpc_conformance_helpers import WAIT, ExecMode, rpc_step, rpc_worker  # noqa: F401  (fixtures)

pytestmark = pytest.mark.mpi(min_size=2)

# --- contexts -------------------------------------------------------------------------------------
def test_autograd_context():
    rank, _ = h.rank_and_size()
    context_ids = []
    for _ in range(200):
        with dist_autograd.context() as context_id:
            assert h.retrieve_context(context_id).context_id == context_id
            assert context_id >> 48 == rank  # the first 16 bits are the worker id
            context_ids.append(context_id)
    for context_id in context_ids:
        with pytest.raises(RuntimeError,
                           match=f"Could not find autograd context with id: {context_id}"):
            h.retrieve_context(context_id)


def test_nested_context():
    with dist_autograd.context():
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this "
                                               "thread"):
            with dist_autograd.context():
                pass


# --- the graph one RPC records --------------------------------------------------------------------
def check_graph(fn, mode):
    """PyTorch's _test_graph: the caller's send/recv pair, and the callee's send function."""
    rank, size = h.rank_and_size()
    dst = (rank + 1) % size
    with dist_autograd.context() as context_id:
        t1 = hg.ones(3, 3, requires_grad=True)
        t2 = hg.zeros(3, 3, requires_grad=True)
        ret = h.exec_func_with_dst(dst, mode, fn, t1, t2)
        h.tell_done(context_id, 1)
        ctx = h.current_context()
        assert ctx.context_id == context_id
        sends, recvs = h.send_functions(ctx), h.recv_functions(ctx)
        try:
            assert len(sends) == 1, [h.next_names(s) for s in sends]
            assert len(recvs) == 1
            h.verify_graph_for_first_rpc_call(sends[0], recvs[0], t1, t2, ret)
            h.check_rpc_done(1)
            sends = h.send_functions(h.retrieve_context(h.ctx_ids[1]))
            assert len(sends) == 1, [h.next_names(s) for s in sends]
            h.verify_graph_for_rpc_call_exec(sends[0])
        finally:
            h.barrier()  # no rank releases its context while another still looks at it
    with pytest.raises(RuntimeError):
        h.retrieve_context(context_id)
    with pytest.raises(RuntimeError):
        h.current_context()


def test_graph_for_builtin_call():
    check_graph(hg.add, ExecMode.RPC_SYNC)


def test_graph_for_python_call():
    check_graph(h.my_py_add, ExecMode.RPC_SYNC)


def test_graph_for_builtin_remote_call():
    check_graph(hg.add, ExecMode.REMOTE)


def test_graph_for_python_remote_call():
    check_graph(h.my_py_add, ExecMode.REMOTE)


def check_graph_for_py_nested_call(mode):
    """3-layer nested calls: this rank's graph as caller, as 1st and 2nd hop, and as callee."""
    rank, size = h.rank_and_size()
    dst = (rank + 1) % size
    with dist_autograd.context() as context_id:
        t1 = hg.ones(3, 3, requires_grad=True)
        t2 = hg.zeros(3, 3, requires_grad=True)
        ret = h.exec_func_with_dst(dst, mode, h.my_py_nested_call, t1, t2, dst, size, 1)
        h.barrier()
        for rd in (1, 2, 3):
            h.tell_done(context_id, rd)
        h.barrier()
        try:
            ctx = h.current_context()
            sends, recvs = h.send_functions(ctx), h.recv_functions(ctx)
            assert len(sends) == 1 and len(recvs) == 1, [h.next_names(s) for s in sends]
            h.verify_graph_for_first_rpc_call(sends[0], recvs[0], t1, t2, ret)
            # With fewer than 4 ranks several hops land on one rank, in one context: PyTorch's
            # per-hop checks hold only when the hops' contexts differ.
            if size >= 4:
                h.verify_graph_for_nested_rpc_call(h.retrieve_context(h.ctx_ids[1]))
                h.verify_graph_for_nested_rpc_call(h.retrieve_context(h.ctx_ids[2]))
                sends = h.send_functions(h.retrieve_context(h.ctx_ids[3]))
                assert len(sends) == 1
                h.verify_graph_for_rpc_call_exec(sends[0])
        finally:
            h.barrier()


@pytest.mark.mpi(min_size=4)  # four hops, four distinct ranks (PyTorch runs it at 4)
def test_graph_for_py_nested_call():
    check_graph_for_py_nested_call(ExecMode.RPC_SYNC)


@pytest.mark.mpi(min_size=4)  # four hops, four distinct ranks (PyTorch runs it at 4)
def test_graph_for_py_nested_remote_call():
    check_graph_for_py_nested_call(ExecMode.REMOTE)


def check_graph_for_py_nested_call_itself(mode):
    """rank -> rank + 1 -> rank: this rank is both the caller and the callee of add."""
    rank, size = h.rank_and_size()
    dst = (rank + 1) % size
    with dist_autograd.context() as context_id:
        t1 = hg.ones(3, 3, requires_grad=True)
        t2 = hg.zeros(3, 3, requires_grad=True)
        ret = h.exec_func_with_dst(dst, mode, h.my_py_nested_call, t1, t2,
                                   (rank - 1 + size) % size, size, 0)
        h.tell_done(context_id, 1)
        try:
            ctx = h.current_context()
            assert ctx.context_id == context_id
            sends, recvs = h.send_functions(ctx), h.recv_functions(ctx)
            assert len(sends) == 2 and len(recvs) == 2, [h.next_names(s) for s in sends]
            h.verify_graph_for_first_rpc_call(sends[0], recvs[1], t1, t2, ret)
            h.verify_graph_for_rpc_call_exec(sends[1])
            h.check_rpc_done(1)
            h.verify_graph_for_nested_rpc_call(h.retrieve_context(h.ctx_ids[1]))
        finally:
            h.barrier()


def test_graph_for_py_nested_call_itself():
    check_graph_for_py_nested_call_itself(ExecMode.RPC_SYNC)


def test_graph_for_py_nested_remote_call_itself():
    check_graph_for_py_nested_call_itself(ExecMode.REMOTE)


def check_no_graph_with_tensors_not_require_grad(mode):
    rank, size = h.rank_and_size()
    dst = (rank + 1) % size
    with dist_autograd.context() as context_id:
        t1 = hg.ones(3, 3, requires_grad=False)
        t2 = hg.zeros(3, 3, requires_grad=False)
        h.exec_func_with_dst(dst, mode, hg.add, t1, t2)
        h.tell_done(context_id, 1)
        try:
            ctx = h.current_context()
            assert len(h.send_functions(ctx)) == 0
            assert len(h.recv_functions(ctx)) == 0
            h.check_rpc_done(1)
            # The context travels with every call (the result might need it): it exists here.
            h.retrieve_context(h.ctx_ids[1])
        finally:
            h.barrier()


def test_no_graph_with_tensors_not_require_grad():
    check_no_graph_with_tensors_not_require_grad(ExecMode.RPC_SYNC)


def test_no_graph_with_tensors_not_require_grad_remote():
    check_no_graph_with_tensors_not_require_grad(ExecMode.REMOTE)


def check_grad_only_on_return_value(mode):
    rank, size = h.rank_and_size()
    dst = (rank + 1) % size
    with dist_autograd.context() as context_id:
        ret = h.exec_func_with_dst(dst, mode, h.ret_requires_grad)
        h.backward(context_id, [ret.sum()])
        h.tell_done(context_id, 1)
        try:
            h.check_rpc_done(1)
            grads = dist_autograd.get_gradients(h.ctx_ids[1])
            assert len(grads) == 1
            assert h.requires_grad_tensor in grads
            h.assert_close(grads[h.requires_grad_tensor], np.ones((3, 3), np.float32))
        finally:
            h.barrier()


def test_grad_only_on_return_value():
    check_grad_only_on_return_value(ExecMode.RPC_SYNC)


def test_grad_only_on_return_value_remote():
    check_grad_only_on_return_value(ExecMode.REMOTE)


def check_rpc_complex_args(mode):
    with dist_autograd.context():
        tensors = [hg.ones(3, 3, requires_grad=(i % 2 == 0)) for i in range(10)]
        dst = h.Ring().next()
        ret = h.exec_func_with_dst(dst, mode, hg.stack, tensors)
        h.assert_close(ret, hg.stack(tensors))
        # One send function for the message, with an edge per tensor that requires grad.
        sends = h.send_functions(h.current_context())
        assert len(sends) == 1, [h.next_names(s) for s in sends]
        next_funcs = sends[0].next_functions
        assert len(next_funcs) == 5
        for (fn, _), t in zip(next_funcs, tensors[::2]):
            assert fn.name() == "AccumulateGrad" and fn.variable is t
        assert h.current_context().known_workers == {dst}


def test_rpc_complex_args():
    check_rpc_complex_args(ExecMode.RPC_SYNC)


def test_remote_complex_args():
    check_rpc_complex_args(ExecMode.REMOTE)


# --- context cleanup ------------------------------------------------------------------------------
def check_context_cleanup(rpc_args, func, nested=False):
    """Contexts the calls created on other ranks are released with ours, also when no tensor
    required grad (the context travels anyway), and through nested calls."""
    rank, size = h.rank_and_size()
    if nested:
        dst_ranks = {(rank + 1) % size}
        nested_dst = (rank + 2) % size
    else:
        dst_ranks = {r for r in range(size) if r != rank}
    with dist_autograd.context() as context_id:
        for dst in dst_ranks:
            rpc.rpc_sync(h.worker_name(dst), func, args=rpc_args, timeout=WAIT)
            rpc.rpc_sync(h.worker_name(dst), h.set_rpc_done, args=(context_id, 1), timeout=WAIT)
            if nested:
                rpc.rpc_sync(h.worker_name(nested_dst), h.set_rpc_done, args=(context_id, 2),
                             timeout=WAIT)
    with pytest.raises(RuntimeError):
        h.retrieve_context(context_id)
    h.barrier()  # every peer has finished adding to known_context_ids
    assert h.all_contexts_cleaned_up()


def test_context_cleanup_tensor_with_grad():
    t1 = hg.ones(3, 3, requires_grad=True)
    t2 = hg.zeros(3, 3, requires_grad=True)
    check_context_cleanup((t1, t2), hg.add)


def test_context_cleanup_tensor_no_grad():
    t1 = hg.ones(3, 3, requires_grad=False)
    check_context_cleanup((t1, t1), hg.add)


def test_context_cleanup_no_tensors():
    check_context_cleanup((1, 1), h.my_scalar_add)


def test_context_cleanup_nested_rpc():
    rank, size = h.rank_and_size()
    t1 = hg.ones(3, 3, requires_grad=True)
    t2 = hg.zeros(3, 3, requires_grad=True)
    dst = (rank + 1) % size
    check_context_cleanup((t1, t2, dst, size, 0), h.my_py_nested_call, nested=True)


def test_worker_ids_recorded():
    rank, size = h.rank_and_size()
    dst_ranks = {r for r in range(size) if r != rank}
    with dist_autograd.context() as context_id:
        # No tensor requires grad: the context id still travels, so the workers are recorded.
        t1 = hg.ones(3, 3, requires_grad=False)
        t2 = hg.zeros(3, 3, requires_grad=False)
        for dst in dst_ranks:
            rpc.rpc_sync(h.worker_name(dst), hg.add, args=(t1, t2), timeout=WAIT)
            rpc.rpc_sync(h.worker_name(dst), h.set_rpc_done, args=(context_id, 1), timeout=WAIT)
        ctx = h.current_context()
        assert ctx.known_workers == dst_ranks
        t1.requires_grad = True
        t2.requires_grad = True
        for dst in dst_ranks:
            rpc.rpc_sync(h.worker_name(dst), hg.add, args=(t1, t2), timeout=WAIT)
            rpc.rpc_sync(h.worker_name(dst), h.set_rpc_done, args=(context_id, 1), timeout=WAIT)
        assert ctx.known_workers == dst_ranks


def test_error_in_context():
    with dist_autograd.context():
        t1 = hg.rand(3, 3, requires_grad=True)
        t2 = hg.rand(6, 6, requires_grad=True)
        with pytest.raises(Exception) as local:  # sizes do not match
            hg.matmul(t1, t2)
        # The remote op fails as the local one does.
        with pytest.raises(type(local.value)):
            rpc.rpc_sync(h.worker_name(h.Ring().next()), hg.matmul, args=(t1, t2), timeout=WAIT)


def test_debug_info():
    rank, size = h.rank_and_size()
    t1 = hg.rand(3, 3, requires_grad=True)
    t2 = hg.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        res = t1
        for r in range(size):
            if r != rank:
                res = rpc.rpc_sync(h.worker_name(r), hg.add, args=(res, t2), timeout=WAIT)
        # A function in the middle of the pass checks it is counted as running.
        res = h.DebugInfoFunc.apply(res)
        for r in range(size):
            if r != rank:
                res = rpc.rpc_sync(h.worker_name(r), hg.add, args=(res, t2), timeout=WAIT)
        h.backward(context_id, [res.sum()])
        contexts = int(dist_autograd._get_debug_info()["num_autograd_contexts"])
        assert 1 <= contexts <= 4
    for rd in range(size - 1):
        h.tell_done(context_id, rd + 1)
    h.barrier()
    debug_info = dist_autograd._get_debug_info()
    assert int(debug_info["num_current_backward_passes"]) == 0
    assert len(debug_info) == 2
    assert h.all_contexts_cleaned_up()
    assert int(dist_autograd._get_debug_info()["num_autograd_contexts"]) == 0
