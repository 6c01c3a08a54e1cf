"""RPC (issue 11): default timeout, RRef(value) and reference counting, remote errors logged where
they happen, replies off the progress thread, and the layering (rpc knows nothing of autograd).

The layering checks read the source (one process); the rest runs under mpiexec, rank 0 driving.
"""

import ast
import gc
import pathlib
import threading
import time

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)

PACKAGE = pathlib.Path(hg.__file__).parent


def driver():
    return rank_and_size()[0] == 0


def last_rank():
    return rank_and_size()[1] - 1


# --- layering (source checks, one process) ------------------------------------------------------------
def _modules(folder):
    found = sorted((PACKAGE / folder).glob("*.py"))
    assert found, f"hpcgrad/{folder} holds no module: a moved folder?"
    return found


def _imports(path):
    """(module named, inside a function?) for every import statement of ``path``."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append(("." * child.level + (child.module or ""), in_function))
            visit(child, nested)

    visit(tree, False)
    return found


@pytest.mark.parametrize("path", _modules("rpc"), ids=lambda p: p.name)
def test_rpc_imports_nothing_of_autograd(path):
    for module, _ in _imports(path):
        assert "autograd" not in module, f"{path.name} imports {module}: rpc must not know " \
                                         "autograd (Note [RPC codec])"


@pytest.mark.parametrize("path", _modules("rpc") + _modules("dist_autograd"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_lazy_imports(path):
    lazy = [module for module, in_function in _imports(path) if in_function]
    assert not lazy, f"{path.name} imports {lazy} inside functions"


@pytest.mark.parametrize("path", _modules("dist_autograd"), ids=lambda p: p.name)
def test_dist_autograd_sets_no_graph_task_field(path):
    """The distributed engine uses GraphTask's methods; it writes none of its fields."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign) else [])
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    assert "graph_task" not in t.value.id, \
                        f"{path.name}:{node.lineno} sets {t.value.id}.{t.attr}"


# --- default timeout ----------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_rpc_timeouts_default():
    if not driver():
        return
    rpc.rpc_sync(1, cases.reset_wake)
    assert rpc.get_rpc_timeout() == rpc.DEFAULT_RPC_TIMEOUT
    try:
        rpc._set_rpc_timeout(0.2)
        assert rpc.get_rpc_timeout() == 0.2
        with pytest.raises(TimeoutError, match="timed out after 0.2 s"):
            rpc.rpc_sync(1, cases.sleep_until_woken, args=(2,))
        with pytest.raises(TimeoutError, match="timed out after 0.2 s"):
            rpc.rpc_async(1, cases.sleep_until_woken, args=(2,)).wait()
        # an explicit timeout overrides the default
        rpc._set_rpc_timeout(0.001)
        assert rpc.rpc_sync(1, cases.add, args=(1, 2), timeout=WAIT_LIMIT) == 3
        with pytest.raises(ValueError, match="seconds >= 0"):
            rpc._set_rpc_timeout(-1)
    finally:
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)
        rpc.rpc_sync(1, cases.wake)
    cases.wait_until_idle([0, 1])


# --- RRefs ---------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_local_rref_no_fork():
    rref = rpc.RRef(35)
    assert rref.is_owner() and rref.local_value() == 35 and rref.to_here() == 35
    assert rref.owner() == rpc.get_worker_info()


def _owned_count():
    with rpc._rref_lock:
        return len(rpc._rrefs)


def _wait_for_owned(count, limit=5):
    deadline = time.monotonic() + limit
    while _owned_count() != count:
        if time.monotonic() > deadline:
            raise AssertionError(f"this rank keeps {_owned_count()} RRef values, expected {count}")
        gc.collect()
        time.sleep(0.01)


@pytest.mark.mpi(min_size=2)
def test_rref_context_debug_info():
    """The owner keeps a value while some rank holds an RRef to it, and frees it after (values
    lived until shutdown). Counted: RRef(value) once shared, remote() results, forwarded copies."""
    rank, size = rank_and_size()
    peer = (rank + 1) % size
    mine = rpc.RRef(hg.tensor([float(rank)]))
    assert _owned_count() == 0  # not shared yet
    cases.barrier()
    rpc.rpc_sync(peer, cases.keep, args=("shared", mine), timeout=WAIT_LIMIT)
    cases.barrier()
    assert _owned_count() == 1
    cases.barrier()
    rpc.rpc_sync(peer, cases.drop, args=("shared",), timeout=WAIT_LIMIT)
    _wait_for_owned(0)
    cases.barrier()
    # remote() results, one of them forwarded by its creator to a third rank and dropped here
    a = rpc.remote(peer, hg.add, args=(hg.ones(2), 1.0), timeout=WAIT_LIMIT)
    b = rpc.remote(peer, hg.add, args=(hg.ones(2), 2.0), timeout=WAIT_LIMIT)
    np.testing.assert_array_equal(a.to_here(WAIT_LIMIT).array, [2.0, 2.0])
    rpc.rpc_sync((peer + 1) % size, cases.keep, args=("forwarded", b), timeout=WAIT_LIMIT)
    cases.barrier()
    assert _owned_count() == 2
    cases.barrier()
    del a, b
    gc.collect()
    cases.barrier()
    _wait_for_owned(1)  # b is still held by the rank it was forwarded to
    cases.barrier()
    np.testing.assert_array_equal(cases.kept("forwarded").to_here(WAIT_LIMIT).array, [3.0, 3.0])
    cases.drop("forwarded")
    gc.collect()
    _wait_for_owned(0)


# --- errors and callbacks ------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_remote_error_is_logged_where_it_happened():
    if not driver():
        return
    rpc.rpc_sync(1, cases.capture_rpc_log)
    with pytest.raises(ValueError, match="logged 17"):
        rpc.rpc_sync(1, cases.raise_value_error, args=("logged 17",))
    log = rpc.rpc_sync(1, cases.rpc_log)
    assert len(log) == 1 and "worker1 (rank 1) failed serving an RPC from rank 0" in log[0]
    assert "ValueError: logged 17" in log[0] and "raise_value_error" in log[0]


@pytest.mark.mpi(min_size=2)
def test_callback_with_ret():
    """A then() callback may wait for another RPC (replies are resolved on a pool, not on the
    progress thread, which that reply needs)."""
    if not driver():
        return
    seen = []

    def callback(fut):
        seen.append(threading.current_thread().name)
        return rpc.rpc_sync(1, cases.add, args=(fut.wait(), 1), timeout=WAIT_LIMIT)

    fut = rpc.rpc_async(1, cases.add, args=(1, 1), timeout=WAIT_LIMIT).then(callback)
    assert fut.wait(WAIT_LIMIT) == 3
    assert "progress" not in seen[0], seen
