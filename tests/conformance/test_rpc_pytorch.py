"""Ports of PyTorch's RpcTest basics (rpc_test.py): calls, user functions, RRefs, remote errors,
futures, timeouts and worker info.

Every rank runs each test at once, calling its ring peer ``(rank + 1) % world_size``, as in
PyTorch (2, 3 and 4 ranks). torch.add and friends become hg.add; torch.futures.wait_all becomes
the helper's wait_all. Left out:
- the profiler tests: the profiler.
- TorchScript functions (test_stress_heavy_rpc_torchscript, ...): TorchScript.
- @rpc.functions.async_execution tests: not built.
- device maps, CUDA futures, custom streams: CUDA.
- TensorPipe and backend options, dynamic RPC membership: TensorPipe-specific.
- RRef proxies (rref.rpc_sync()/remote()), RRef.backward, _wait_all, _all_gather,
  test_rref_leak: not built.
- test_handle_send_exceptions and the faulty-agent tests: they kill ranks.
- test_nonzero: hpcgrad has no nonzero.
- test_rref_str: it checks the text of PyTorch's GloballyUniqueId.
- test_py_nested_pickle: it uses PyTorch's internal RPC pickler.
- test_my_parameter_server: EmbeddingBag and RRef proxies.
"""

import concurrent.futures
import functools

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc

import rpc_conformance_helpers as h
from rpc_conformance_helpers import WAIT, rpc_step, rpc_worker  # noqa: F401  (fixtures)

pytestmark = pytest.mark.mpi(min_size=2)
SYNC, ASYNC, REMOTE = "sync", "async", "remote"


def run_in_mode(to, fn, mode, args=None, kwargs=None, timeout=WAIT):
    """PyTorch's _run_func_in_mode."""
    if mode == SYNC:
        return rpc.rpc_sync(to, fn, args=args, kwargs=kwargs, timeout=timeout)
    if mode == ASYNC:
        return rpc.rpc_async(to, fn, args=args, kwargs=kwargs, timeout=timeout).wait(WAIT)
    return rpc.remote(to, fn, args=args, kwargs=kwargs, timeout=timeout).to_here(WAIT)


def peer(distance=1):
    rank, size = h.rank_and_size()
    return (rank + distance) % size


def assert_equal(got, want):
    got = got.array if isinstance(got, hg.Tensor) else got
    want = want.array if isinstance(want, hg.Tensor) else want
    np.testing.assert_array_equal(got, want)
    if isinstance(want, np.ndarray):
        assert got.shape == want.shape


# --- worker info and destinations -----------------------------------------------------------------
def test_worker_id():
    rank, _ = h.rank_and_size()
    assert rpc.get_worker_info().name == h.worker_name(rank)
    assert rpc.get_worker_info(h.worker_name(peer())).name == h.worker_name(peer())
    with pytest.raises(RuntimeError, match="could not find destination"):
        rpc.get_worker_info("WorkerUnknown")


def test_get_worker_infos():
    _, size = h.rank_and_size()
    infos = [rpc.get_worker_info(h.worker_name(r)) for r in range(size)]
    assert {i.name for i in infos} == {h.worker_name(r) for r in range(size)}
    assert {i.id for i in infos} == set(range(size))


def test_self_add():
    me = rpc.get_worker_info()
    fut = rpc.rpc_async(me, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    ret = rpc.rpc_sync(me, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    assert_equal(fut.wait(WAIT), hg.ones(2, 2) + 1)
    assert_equal(ret, hg.ones(2, 2) + 1)


@pytest.mark.parametrize("mode", [SYNC, ASYNC, REMOTE])
def test_send_to_rank(mode):
    ret = run_in_mode(peer(), hg.add, mode, args=(hg.ones(2, 2), 1))
    assert_equal(ret, hg.ones(2, 2) + 1)


@pytest.mark.parametrize("mode", [SYNC, ASYNC, REMOTE])
def test_send_to_rank_invalid(mode):
    """The invalid-rank half of PyTorch's test_send_to_rank."""
    _, size = h.rank_and_size()
    for bad in (size + 1, -1):
        with pytest.raises(RuntimeError):
            run_in_mode(bad, hg.add, mode, args=(hg.ones(2, 2), 1))


@pytest.mark.parametrize("mode", [SYNC, ASYNC, REMOTE])
def test_send_to_rank_fractional(mode):
    """The fractional-rank half of PyTorch's test_send_to_rank."""
    for bad in (peer() + 0.5, peer() - 0.5):
        with pytest.raises(ValueError):
            run_in_mode(bad, hg.add, mode, args=(hg.ones(2, 2), 1))


def test_worker_info_pickle():
    info = rpc.get_worker_info()
    assert rpc.rpc_sync(h.worker_name(peer()), h.identity, args=(info,), timeout=WAIT) == info


def test_int_callee():
    assert rpc.rpc_sync(peer(), h.return_callee_id, timeout=WAIT) == peer()


def test_expected_src():
    rank, size = h.rank_and_size()
    rpc.rpc_sync(h.worker_name(peer()), h.set_value, args=(rank,), timeout=WAIT)
    assert h.value_future.result(WAIT) == (rank - 1) % size


# --- builtin-like and user functions --------------------------------------------------------------
def ones_n():
    n = h.rank_and_size()[0] + 1
    return n, hg.ones(n, n)


def test_add():
    n, x = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), hg.add, args=(x, hg.ones(n, n)), timeout=WAIT)
    assert_equal(ret, hg.ones(n, n) * 2)


def test_add_with_id():
    n, x = ones_n()
    info = rpc.get_worker_info(h.worker_name(peer()))
    assert_equal(rpc.rpc_sync(info, hg.add, args=(x, hg.ones(n, n)), timeout=WAIT), x * 2)


def test_scalar_add():
    n, x = ones_n()
    assert_equal(rpc.rpc_sync(h.worker_name(peer()), hg.add, args=(x, n), timeout=WAIT), x + n)


def test_async_add():
    n, x = ones_n()
    fut = rpc.rpc_async(h.worker_name(peer()), hg.add, args=(x, hg.ones(n, n)), timeout=WAIT)
    assert_equal(fut.wait(WAIT), x * 2)


def test_multi_rpc():
    for _ in range(20):
        x, y = hg.ones(2, 2), hg.ones(2, 2)
        assert_equal(rpc.rpc_sync(h.worker_name(peer()), hg.add, args=(x, y), timeout=WAIT),
                     x * 2)


def test_future_wait_twice():
    futs = [rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT) for _ in range(20)]
    with pytest.raises(ValueError, match="Expected error"):
        h.wait_all(futs)
    for fut in futs:
        with pytest.raises(ValueError, match="Expected error"):
            fut.wait(WAIT)


def test_py_built_in():
    n, _ = ones_n()
    assert rpc.rpc_sync(h.worker_name(peer()), min, args=(n, n + 1, n + 2), timeout=WAIT) == n


def test_py_user_defined():
    n, _ = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.my_function,
                       kwargs={"a": n, "b": n + 1, "c": n + 2}, timeout=WAIT)
    assert ret == h.my_function(n, n + 1, n + 2)


def test_py_class_constructor():
    n, _ = ones_n()
    assert rpc.rpc_sync(h.worker_name(peer()), h.MyClass, args=(n,), timeout=WAIT).a == n


def test_py_class_instance_method():
    n, _ = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.MyClass(2).my_instance_method, args=(n,),
                       timeout=WAIT)
    assert ret == h.MyClass(2).my_instance_method(n)


def test_py_class_method():
    n, _ = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.MyClass.my_class_method, args=(n, n + 1),
                       timeout=WAIT)
    assert ret == h.MyClass.my_class_method(n, n + 1)


def test_py_class_static_method():
    n, _ = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.MyClass.my_static_method, args=(n + 10,),
                       timeout=WAIT)
    assert ret == h.MyClass.my_static_method(n + 10)


def test_py_multi_async_call():
    n, _ = ones_n()
    info = rpc.get_worker_info(h.worker_name(peer()))
    fut1 = rpc.rpc_async(info, h.MyClass.my_static_method, args=(n + 10,), timeout=WAIT)
    fut2 = rpc.rpc_async(info, min, args=(n, n + 1, n + 2), timeout=WAIT)
    assert fut1.wait(WAIT) == h.MyClass.my_static_method(n + 10)
    assert fut2.wait(WAIT) == min(n, n + 1, n + 2)


def test_py_no_return_result():
    assert rpc.rpc_sync(h.worker_name(peer()), h.no_result, timeout=WAIT) is None


def test_py_tensors():
    n, x = ones_n()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.my_tensor_function, args=(x, hg.ones(n, n)),
                       timeout=WAIT)
    assert_equal(ret, h.my_tensor_function(x, hg.ones(n, n)))


def test_py_tensors_multi_async_call():
    futs = [rpc.rpc_async(h.worker_name(peer()), h.my_tensor_function,
                          args=(hg.ones(i, i), hg.ones(i, i)), timeout=WAIT)
            for i in range(100)]
    for j, val in enumerate(h.wait_all(futs)):
        assert_equal(val, h.my_tensor_function(hg.ones(j, j), hg.ones(j, j)))


def test_py_tensors_in_container():
    n, _ = ones_n()
    a = [hg.ones(n, n), hg.ones(n, n)]
    b = h.TensorClass(h.build_complex_tensors())
    c = {"foo": hg.ones(n, n), "bar": hg.ones(n, n)}
    ret = rpc.rpc_sync(h.worker_name(peer()), h.my_complex_tensor_function, args=(a, b, c),
                       timeout=WAIT)
    want = h.my_complex_tensor_function(a, b, c)
    assert_equal(ret[0], want[0])
    assert_equal(ret[1], want[1])
    for got, expected in zip(ret[2], want[2]):
        assert_equal(got, expected)


def test_py_function_exception():
    with pytest.raises(TypeError):
        rpc.rpc_sync(h.worker_name(peer()), h.no_result, args=(10,), timeout=WAIT)


def test_py_raise_in_user_func():
    fut = rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT)
    with pytest.raises(ValueError, match=h.expected_err):
        fut.wait(WAIT)


def test_py_raise_in_user_func_escaped_str():
    fut = rpc.rpc_async(h.worker_name(peer()), h.raise_func_escape, timeout=WAIT)
    with pytest.raises(ValueError) as info:
        fut.wait(WAIT)
    msg = str(info.value)
    # Newlines stay newlines, so the remote error reads as it was written.
    assert msg == msg.encode("utf-8").decode("unicode_escape")


def test_nested_rpc():
    rank, _ = h.rank_and_size()
    ret = rpc.rpc_sync(h.worker_name(peer()), h.nested_rpc, args=(h.worker_name(rank),),
                       timeout=WAIT)
    assert_equal(ret, hg.ones(2, 2) + 1)


def check_stress(fn, repeat, args=()):
    futs = [rpc.rpc_async(h.worker_name(peer()), fn, args=args, timeout=WAIT)
            for _ in range(repeat)]
    assert h.wait_all(futs) == [0] * repeat


def test_stress_light_rpc():
    check_stress(h.light_rpc, 1000)


def test_stress_heavy_rpc():
    check_stress(h.heavy_rpc, 20, args=(hg.ones(100, 100),))


@pytest.mark.mpi(min_size=3)
def test_graceful_shutdown_with_uneven_workload():
    """PyTorch's _run_uneven_workload: worker0 keeps worker1, then worker2, busy while the rest
    wait; nobody leaves before the work is done (here: the barrier ending every test)."""
    if h.rank_and_size()[0] != 0:
        return
    x = hg.ones(100, 100)
    for dst in ("worker1", "worker2"):
        futs = [rpc.rpc_async(dst, h.heavy_rpc, args=(x,), timeout=WAIT) for _ in range(30)]
        assert h.wait_all(futs) == [0] * 30


def test_multi_layer_nested_async_rpc():
    """Returns at once, leaving a chain of 20 asynchronous RPCs around the ring: the end of the
    test (every rank meets, serving meanwhile) must not cut it."""
    _, size = h.rank_and_size()
    h.multi_layer_nested_async_rpc(peer(), size, 20)


# --- remote and RRefs -----------------------------------------------------------------------------
def test_builtin_remote_ret():
    rref = rpc.remote(h.worker_name(peer()), hg.add, args=(hg.ones(2, 2), hg.ones(2, 2)),
                      timeout=WAIT)
    assert_equal(rref.to_here(WAIT), hg.ones(2, 2) * 2)


def test_builtin_remote_self():
    rank, _ = h.rank_and_size()
    rref = rpc.remote(h.worker_name(rank), hg.add, args=(hg.ones(2, 2), hg.ones(2, 2)),
                      timeout=WAIT)
    rref.to_here(WAIT)  # PyTorch's local_value() waits for the value; hpcgrad's too, below
    assert_equal(rref.local_value(), hg.ones(2, 2) * 2)


def check_multi_remote_call(fn, args_fn=lambda n: (), kwargs_fn=lambda n: {}):
    n = h.rank_and_size()[0] + 1
    rrefs, expected = [], []
    for i in range(10):
        n = n + i
        rrefs.append(rpc.remote(h.worker_name(peer()), fn, args=args_fn(n), kwargs=kwargs_fn(n),
                                timeout=WAIT))
        expected.append(fn(*args_fn(n), **kwargs_fn(n)))
    for rref, want in zip(rrefs, expected):
        assert_equal(rref.to_here(WAIT), want)


def test_multi_builtin_remote_ret():
    check_multi_remote_call(hg.add, args_fn=lambda n: (hg.ones(n, n), hg.ones(n, n)))


def test_py_udf_remote():
    n, _ = ones_n()
    rref = rpc.remote(h.worker_name(peer()), h.my_function,
                      kwargs={"a": n, "b": n + 1, "c": n + 2}, timeout=WAIT)
    assert rref.to_here(WAIT) == h.my_function(n, n + 1, n + 2)


def test_multi_py_udf_remote():
    check_multi_remote_call(h.my_function, kwargs_fn=lambda n: {
        "a": hg.ones(n, n), "b": hg.ones(n, n), "c": hg.ones(n, n)})


def test_self_py_udf_remote():
    x, y, z = hg.ones(2, 2), 1, 3
    rref = rpc.remote(rpc.get_worker_info(), h.my_function, args=(x, y, z), timeout=WAIT)
    assert_equal(rref.to_here(WAIT), x + y + z)


@pytest.mark.parametrize("dst_is_self", [False, True])
def test_self_remote_rref_as_rpc_arg(dst_is_self):
    """Also PyTorch's test_self_remote_rref_as_self_rpc_arg (dst_is_self)."""
    dst = rpc.get_worker_info() if dst_is_self else h.worker_name(peer())
    x, y, z = hg.ones(2, 2), 1, 3
    rref = rpc.remote(rpc.get_worker_info(), h.my_function, args=(x, y, z), timeout=WAIT)
    fut = rpc.rpc_async(dst, h.add_rref_to_value, args=(rref, x), timeout=WAIT)
    ret = rpc.rpc_sync(dst, h.add_rref_to_value, args=(rref, x + y), timeout=WAIT)
    assert_equal(ret, x + y + z + x + y)
    assert_equal(fut.wait(WAIT), x + y + z + x)


@pytest.mark.parametrize("dst_is_self", [False, True])
def test_self_remote_rref_as_remote_arg(dst_is_self):
    """Also PyTorch's test_self_remote_rref_as_self_remote_arg (dst_is_self)."""
    dst = rpc.get_worker_info() if dst_is_self else h.worker_name(peer())
    x, y, z = hg.ones(2, 2), 1, 3
    rref = rpc.remote(rpc.get_worker_info(), h.my_function, args=(x, y, z), timeout=WAIT)
    ret_rref = rpc.remote(dst, h.add_rref_to_value, args=(rref, x), timeout=WAIT)
    assert_equal(ret_rref.to_here(WAIT), x + y + z + x)


def test_py_rref_args():
    dst = h.worker_name(peer())
    rref_a = rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    rref_b = rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 2), timeout=WAIT)
    rref_c = rpc.remote(dst, h.my_rref_function, args=(rref_a, rref_b), timeout=WAIT)
    assert_equal(rref_c.to_here(WAIT), hg.ones(2, 2) * 2 + 3)


def test_py_rref_args_user_share():
    owner, user = h.worker_name(peer()), h.worker_name(peer(2))
    rref_a = rpc.remote(owner, h.my_function, args=(hg.ones(2, 2), 1, 2), timeout=WAIT)
    rref_b = rpc.remote(owner, h.my_function, args=(hg.ones(2, 2), 3, 4), timeout=WAIT)
    rref_c = rpc.remote(user, h.my_rref_function, args=(rref_a, rref_b), timeout=WAIT)
    assert_equal(rref_c.to_here(WAIT), hg.ones(2, 2) * 2 + 10)


def test_py_rpc_rref_args():
    dst = h.worker_name(peer())
    rref_a = rpc.remote(dst, h.my_function, args=(hg.ones(2, 2), 1, 2), timeout=WAIT)
    rref_b = rpc.remote(dst, h.my_function, args=(hg.ones(2, 2), 3, 4), timeout=WAIT)
    c = rpc.rpc_sync(dst, h.my_rref_function, args=(rref_a, rref_b), timeout=WAIT)
    assert_equal(c, hg.ones(2, 2) * 2 + 10)


def test_nested_remote():
    rref = rpc.remote(h.worker_name(peer()), h.nested_remote, args=(h.worker_name(peer(2)),),
                      timeout=WAIT)
    assert_equal(rref.to_here(WAIT), hg.ones(2, 2) + 3)


def check_nested_rref(count):
    all_rrefs = [rpc.remote(h.worker_name(peer()), h.nested_rref,
                            args=(h.worker_name(peer(2)),), timeout=WAIT) for _ in range(count)]
    for rref_of_rrefs in all_rrefs:
        rrefs = rref_of_rrefs.to_here(WAIT)
        assert len(rrefs) == 2
        assert_equal(rrefs[0].to_here(WAIT), hg.ones(2, 2) + 1)
        assert_equal(rrefs[1].to_here(WAIT), hg.ones(2, 2) + 2)


def test_nested_rref():
    check_nested_rref(1)


def test_nested_rref_stress():
    check_nested_rref(20)


def test_remote_with_exception():
    rank, _ = h.rank_and_size()
    rref = rpc.remote(h.worker_name(peer()), h.raise_func, timeout=WAIT)
    with pytest.raises(ValueError):
        rref.to_here(WAIT)
    rref = rpc.remote(h.worker_name(rank), h.no_result, args=(10,), timeout=WAIT)
    with pytest.raises(TypeError):
        rref.to_here(WAIT)


def test_rpc_return_rref():
    rref = rpc.rpc_sync(h.worker_name(peer()), h.rpc_return_rref,
                        args=(h.worker_name(peer(2)),), timeout=WAIT)
    assert_equal(rref.to_here(WAIT), hg.ones(2, 2) + 1)


def test_rref_forward_chain():
    n, x = ones_n()
    _, size = h.rank_and_size()
    ttl = 8
    rref = rpc.remote(h.worker_name(peer()), hg.add, args=(x, 1), timeout=WAIT)
    ret_rref = h.rref_forward_chain(peer(), size, rref, ttl)
    for _ in range(ttl):
        assert len(ret_rref) == 1
        ret_rref = ret_rref[0].to_here(WAIT)
    assert_equal(ret_rref, hg.add(x, 1))


def test_local_rref_no_fork():
    assert rpc.RRef(35).local_value() == 35


def test_local_value_not_on_owner():
    rref = rpc.remote(h.worker_name(peer()), hg.add, args=(hg.ones(1), hg.ones(1)), timeout=WAIT)
    rref.to_here(WAIT)
    # PyTorch: "... can't call localValue() on user WorkerInfo(...). Call it on owner ..."
    with pytest.raises(RuntimeError, match="owned by rank|owner"):
        rref.local_value()


def test_return_local_rrefs():
    rref_list = rpc.rpc_sync(h.worker_name(peer()), h.get_rref_list, args=([1, 2, 3],),
                             timeout=WAIT)
    for rref in rref_list:
        rpc.rpc_sync(rref.owner(), h.call_method,
                     args=(h.MyClass.increment_value, rref, 10), timeout=WAIT)
    rets = [rpc.rpc_sync(rref.owner(), h.call_method, args=(h.MyClass.get_value, rref),
                         timeout=WAIT) for rref in rref_list]
    assert rets == [11, 12, 13]


def test_owner_equality():
    a, b = rpc.RRef(40), rpc.RRef(50)
    other_a = rpc.remote(h.worker_name(peer()), hg.add, args=(hg.ones(1), 1), timeout=WAIT)
    other_b = rpc.remote(h.worker_name(peer()), hg.add, args=(hg.ones(1), 1), timeout=WAIT)
    other_a.to_here(WAIT)
    other_b.to_here(WAIT)
    assert a.owner() != 23
    assert other_a.owner() == other_b.owner()
    assert a.owner() != other_a.owner()
    assert a.owner() == b.owner() == rpc.get_worker_info()
    x = {a.owner(): a, other_a.owner(): other_a}
    assert x[b.owner()] is a and x[other_b.owner()] is other_a and len(x) == 2


def test_pass_local_rrefs():
    dst = h.worker_name(peer())
    rref = rpc.RRef(40)
    assert rpc.rpc_sync(dst, h.add_rref_to_value, args=(rref, 50), timeout=WAIT) == 90
    assert rpc.rpc_async(dst, h.add_rref_to_value, args=(rref, 50), timeout=WAIT).wait(WAIT) == 90
    assert rpc.remote(dst, h.add_rref_to_value, args=(rref, 50),
                      timeout=WAIT).to_here(WAIT) == 90


def test_remote_same_worker():
    n, x = ones_n()
    dst = h.worker_name(peer())
    rref_a = rpc.remote(dst, hg.add, args=(x, 2), timeout=WAIT)
    rref_b = rpc.remote(dst, hg.add, args=(x, 1), timeout=WAIT)
    rref_c = rpc.remote(dst, h.my_rref_function, args=(rref_a, rref_b), timeout=WAIT)
    assert_equal(rref_c.to_here(WAIT), x + 4)


def test_remote_throw():
    rref = rpc.remote(h.worker_name(peer()), h.raise_or_inc, args=(hg.ones(2),), timeout=WAIT)
    with pytest.raises(Exception, match=".*Expected error.*"):
        rref.to_here(WAIT)


@pytest.mark.xfail(strict=True, reason="RPC sends every tensor as a C-contiguous copy "
                                       "(rpc/message.py _host); PyTorch keeps a view's strides")
def test_non_cont_tensors():
    t = hg.rand(5, 5)
    t_view = h.narrow(t, 1, 2, 2)
    assert not t_view.array.flags.c_contiguous
    t_cont = hg.tensor(np.ascontiguousarray(t_view.data))
    t_ret = rpc.rpc_sync(h.worker_name(peer()), h.non_cont_test, args=(t_view, t_cont),
                         timeout=WAIT)
    assert_equal(t_ret, t_view)
    assert not t_ret.array.flags.c_contiguous


# --- futures and callbacks ------------------------------------------------------------------------
def add_future(n_value=None):
    n, x = ones_n()
    return n, rpc.rpc_async(h.worker_name(peer()), hg.add, args=(x, hg.ones(n, n)),
                            timeout=WAIT)


def test_callback_simple():
    n, fut = add_future()
    set_by_cb = concurrent.futures.Future()

    def callback(f):
        ret = f.wait()
        set_by_cb.set_result(ret + 1)

    fut.then(callback)
    assert_equal(fut.wait(WAIT), hg.ones(n, n) * 2)
    assert_equal(set_by_cb.result(WAIT), hg.ones(n, n) * 2 + 1)
    assert_equal(fut.wait(WAIT), hg.ones(n, n) * 2)


def test_callback_wrong_arg_num():
    n, fut = add_future()
    cb_fut = fut.then(h.my_function)
    assert_equal(fut.wait(WAIT), hg.ones(n, n) * 2)
    with pytest.raises(TypeError, match=r"my_function\(\) missing 2 required positional "
                                        r"arguments"):
        cb_fut.wait(WAIT)


def test_callback_wrong_arg_type():
    fut0 = rpc.rpc_async(h.worker_name(peer()), hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    fut1 = fut0.then(lambda x: x + 1)
    with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \+"):
        fut1.wait(WAIT)


def test_callback_multi():
    n, fut = add_future()

    def callback(idx, f):
        return f.wait() + idx

    cb_futs = [fut.then(functools.partial(callback, idx)) for idx in range(10)]
    assert_equal(fut.wait(WAIT), hg.ones(n, n) * 2)
    for idx, cb_fut in enumerate(cb_futs):
        assert_equal(cb_fut.wait(WAIT), hg.ones(n, n) * 2 + idx)


def test_callback_chain():
    n, x = ones_n()
    fut = rpc.rpc_async(h.worker_name(peer()), hg.add, args=(x, 1), timeout=WAIT)
    for _ in range(20):
        fut = fut.then(lambda f: f.wait() + 1)
    assert_equal(fut.wait(WAIT), x + 1 + 20)


def test_callback_in_rpc():
    ret = rpc.rpc_sync(h.worker_name(peer()), h.add_use_future_cb,
                       args=(h.worker_name(peer(2)), hg.ones(2, 2), 1, 2), timeout=WAIT)
    assert_equal(ret, hg.ones(2, 2) + 1 + 2)


def test_callback_with_ret():
    dst = h.worker_name(peer())

    def callback(fut0):
        fut2 = rpc.rpc_async(dst, hg.add, args=(fut0.wait(), 1), timeout=WAIT).then(
            lambda fut1: fut1.wait() + 1)
        return fut2.wait(3)  # bounded: it would never finish

    fut3 = rpc.rpc_async(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT).then(callback)
    assert_equal(fut3.wait(WAIT), hg.ones(2, 2) + 3)


def test_callback_with_error():
    def callback(fut0):
        with pytest.raises(ValueError, match="Expected error"):
            fut0.wait()
        raise RuntimeError("Another expected error")

    fut1 = rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT).then(callback)
    with pytest.raises(RuntimeError, match="Another expected error"):
        fut1.wait(WAIT)


def test_callback_none():
    with pytest.raises(TypeError):
        rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT).then(None)


def test_add_done_callback():
    n, fut = add_future()
    set_by_cb = []
    fut.add_done_callback(lambda f: set_by_cb.append(True))
    fut_then = fut.then(lambda _: True)
    assert_equal(fut.wait(WAIT), hg.ones(n, n) * 2)
    fut_then.wait(WAIT)
    assert set_by_cb == [True]


def test_mark_future_twice():
    fut = rpc.rpc_async(h.worker_name(peer()), hg.add, args=(hg.zeros(2, 2), 1), timeout=WAIT)
    assert_equal(fut.wait(WAIT), hg.zeros(2, 2) + 1)
    with pytest.raises(RuntimeError, match="Future can only be marked completed once"):
        fut.set_result(1)


def test_future_done():
    fut = rpc.rpc_async(h.worker_name(peer()), hg.add, args=(hg.zeros(2), 1), timeout=WAIT)
    fut.wait(WAIT)
    assert fut.done()


def test_future_done_exception():
    fut = rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT)
    with pytest.raises(ValueError, match="Expected error"):
        fut.wait(WAIT)
    assert fut.done()


def test_wait_all_with_exception():
    futs = [rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT) for _ in range(10)]
    with pytest.raises(ValueError, match="Expected error"):
        h.wait_all(futs)


def test_wait_all_with_partial_exception():
    futs = [rpc.rpc_async(h.worker_name(peer()), hg.add, args=(hg.ones(2), 1), timeout=WAIT)
            for _ in range(10)]
    futs.append(rpc.rpc_async(h.worker_name(peer()), h.raise_func, timeout=WAIT))
    with pytest.raises(ValueError, match="Expected error"):
        h.wait_all(futs)


# --- timeouts -------------------------------------------------------------------------------------
def test_rpc_timeouts():
    """The per-call half of PyTorch's test_rpc_timeouts (the default-timeout half is below)."""
    dst = h.worker_name(peer())
    fut = rpc.rpc_async(dst, h.my_sleep_func, args=(1,), timeout=0.1)
    with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
        fut.wait()
    with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
        rpc.rpc_sync(dst, h.my_sleep_func, args=(1,), timeout=0.1)
    rpc.rpc_async(dst, h.my_sleep_func, args=(1,), timeout=5).wait()
    rpc.rpc_sync(dst, h.my_sleep_func, args=(1,), timeout=5)
    # A zero timeout means none.
    rpc.rpc_async(dst, h.my_sleep_func, args=(1,), timeout=0).wait(WAIT)
    rpc.rpc_sync(dst, h.my_sleep_func, args=(1,), timeout=0)


def test_rpc_timeouts_default():
    """The default-timeout half of PyTorch's test_rpc_timeouts."""
    dst = h.worker_name(peer())
    try:
        rpc._set_rpc_timeout(0.001)
        fut = rpc.rpc_async(dst, h.my_sleep_func, args=(1,))
        with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
            fut.wait(WAIT)
        with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
            rpc.rpc_sync(dst, h.my_sleep_func, args=(1,))
        # An explicit timeout overrides the default.
        rpc.rpc_async(dst, h.my_sleep_func, args=(1,), timeout=5).wait(WAIT)
        rpc.rpc_sync(dst, h.my_sleep_func, args=(1,), timeout=5)
    finally:
        if hasattr(rpc, "_set_rpc_timeout"):
            rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)


def test_default_timeout_used():
    dst = h.worker_name(peer())
    try:
        rpc._set_rpc_timeout(0.001)
        futs = [rpc.rpc_async(dst, h.my_sleep_func, args=()) for _ in range(10)]
        for fut in futs:
            with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
                fut.wait(WAIT)
        # A new default applies to new calls only.
        rpc._set_rpc_timeout(200)
        fut1 = rpc.rpc_async(dst, h.my_sleep_func, args=(1,))
        rpc._set_rpc_timeout(0.001)
        fut2 = rpc.rpc_async(dst, h.my_sleep_func, args=(1,))
        with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
            fut2.wait(WAIT)
        fut1.wait(WAIT)
        rpc._set_rpc_timeout(0)  # zero: none
        rpc.rpc_async(dst, h.my_sleep_func, args=()).wait(WAIT)
        assert rpc.get_rpc_timeout() == 0
    finally:
        if hasattr(rpc, "_set_rpc_timeout"):
            rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)


def test_rref_timeout():
    """A remote() whose creation times out: to_here() raises the timeout too."""
    if h.rank_and_size()[0] != 0:
        return
    rref = rpc.remote(h.worker_name(peer()), h.my_sleep_func, args=(2,), timeout=0.01)
    with pytest.raises(RuntimeError, match="timed out|Timed out|timeout"):
        rref.to_here(WAIT)


def test_function_not_on_callee():
    """A function the callee cannot find by name: an error comes back, nothing crashes."""
    rank, _ = h.rank_and_size()
    saved = h.foo_add
    try:
        if rank == 1:
            del h.foo_add
            rpc.rpc_sync("worker0", h.set_value, args=(rank,), timeout=WAIT)
        elif rank == 0:
            h.value_future.result(WAIT)  # worker1 has dropped foo_add
            assert hasattr(h, "foo_add")
            with pytest.raises(Exception, match="foo_add"):
                rpc.rpc_sync("worker1", h.foo_add, timeout=WAIT)
    finally:
        h.barrier()  # worker1 keeps foo_add away until worker0 has called
        h.foo_add = saved
