"""hpcgrad.futures.Future: the rules of Note [One Future], and torch.futures.Future's behaviour."""

import threading

import pytest

from hpcgrad.futures import Future, FutureTimeoutError, collect_all


def test_set_once():
    fut = Future()
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="already completed"):
        fut.set_result(2)
    with pytest.raises(RuntimeError, match="already completed"):
        fut.set_exception(ValueError("late"))
    assert fut.wait() == 1 and fut.value() == 1


def test_racing_producers_use_try_set():
    fut = Future()
    assert fut.try_set_exception(TimeoutError("expired"))
    assert not fut.try_set_result("late reply")
    with pytest.raises(TimeoutError, match="expired"):
        fut.wait()


def test_callbacks_run_outside_the_lock_and_once():
    fut, seen = Future(), []

    def callback(f):
        seen.append(f.value())
        f.add_done_callback(lambda g: seen.append("nested"))  # would deadlock under the lock

    fut.add_done_callback(callback)
    fut.set_result(5)
    assert seen == [5, "nested"]
    fut.add_done_callback(lambda f: seen.append("after"))  # already done: runs at once
    assert seen == [5, "nested", "after"]


def test_a_failing_callback_does_not_stop_the_others(monkeypatch):
    fut, seen, reported = Future(), [], []
    monkeypatch.setattr("sys.unraisablehook", lambda info: reported.append(info.exc_value))
    fut.add_done_callback(lambda f: 1 / 0)
    fut.add_done_callback(lambda f: seen.append(f.value()))
    fut.set_result(3)
    assert seen == [3] and isinstance(reported[0], ZeroDivisionError)


def test_then_chains_values_and_errors():
    fut = Future()
    doubled = fut.then(lambda f: f.wait() * 2)
    failed = fut.then(lambda f: f.wait() / 0)
    fut.set_result(21)
    assert doubled.wait() == 42
    with pytest.raises(ZeroDivisionError):
        failed.wait()
    source = Future()
    chained = source.then(lambda f: f.wait() + 1).then(lambda f: f.wait() + 1)
    source.set_exception(ValueError("at the source"))
    with pytest.raises(ValueError, match="at the source"):  # carried through both links
        chained.wait()


def test_wait_timeout_and_exception():
    fut = Future(describe="all_reduce #3")
    with pytest.raises(FutureTimeoutError, match="all_reduce #3 timed out after 0.01 s"):
        fut.wait(0.01)
    threading.Timer(0.05, fut.set_exception, (KeyError("k"),)).start()
    assert isinstance(fut.exception(5), KeyError)  # waits, then returns the error
    assert fut.done()


def test_wait_fn_drives_completion_once():
    calls = []
    fut = Future(wait_fn=lambda: (calls.append(1), fut.set_result("driven")))
    assert fut.wait() == "driven" and fut.wait() == "driven"
    assert calls == [1]
    lazy = Future(wait_fn=lambda: None)
    with pytest.raises(RuntimeError, match="without completing it"):
        lazy.wait()


def test_set_exception_needs_an_exception():
    with pytest.raises(TypeError, match="expects an exception"):
        Future().set_exception("not an exception")


def test_collect_all():
    futures = [Future() for _ in range(3)]
    combined = collect_all(futures)
    for i, fut in enumerate(futures):
        assert not combined.done()
        fut.set_result(i)
    assert [f.wait() for f in combined.wait()] == [0, 1, 2]
    assert collect_all([]).wait() == []


def test_callbacks_must_be_callable():
    with pytest.raises(TypeError, match="expects a callable, got NoneType"):
        Future().then(None)
    with pytest.raises(TypeError, match="expects a callable, got int"):
        Future().add_done_callback(3)
