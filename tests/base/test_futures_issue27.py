"""hpcgrad.futures.wait_all / collect_all against torch.futures' (issue 27), in one process."""

import threading

import pytest

from hpcgrad import futures as hg_futures
from hpcgrad.futures import Future

WAIT = 10.0


def _run(module, future_type, script):
    """Replay ``script`` (a list of (index, 'ok'|'err', value)) on 3 futures of ``future_type``
    through ``module``'s collect_all and wait_all; what each API returned or raised."""
    futs = [future_type() for _ in range(3)]
    combined = module.collect_all(futs)
    states = []
    for i, kind, value in script:
        states.append(combined.done())
        if kind == "ok":
            futs[i].set_result(value)
        else:
            futs[i].set_exception(ValueError(value))
    states.append(combined.done())
    try:  # the combined future itself fails (not only the futures in its list)
        collected = ("ok", len(combined.wait()))
    except ValueError as exc:
        collected = ("err", str(exc))
    try:
        waited = ("ok", module.wait_all(futs))
    except ValueError as exc:
        waited = ("err", str(exc))
    return states, collected, waited


SCRIPTS = {
    "all_ok": [(0, "ok", 1), (2, "ok", 3), (1, "ok", 2)],
    "one_fails": [(0, "ok", 1), (1, "err", "b"), (2, "ok", 3)],
    # errors come in the order 2 then 0: both APIs report the first failed in list order
    "two_fail": [(2, "err", "c"), (1, "ok", 2), (0, "err", "a")],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_collect_all_and_wait_all_as_torch(name):
    torch = pytest.importorskip("torch")
    want = _run(torch.futures, torch.futures.Future, SCRIPTS[name])
    got = _run(hg_futures, Future, SCRIPTS[name])
    assert got == want


def test_collect_all_keeps_the_futures_and_empty_lists():
    futs = [Future(), Future()]
    combined = hg_futures.collect_all(futs)
    futs[1].set_result("y")
    futs[0].set_result("x")
    assert combined.wait(WAIT) == futs  # the same futures, completed, in order
    assert hg_futures.collect_all([]).wait(WAIT) == []
    assert hg_futures.wait_all([]) == []


def test_wait_all_waits_for_every_future_before_raising():
    """As torch's: an error is raised only once every future, also one still pending, is done."""
    slow, failed = Future(), Future()
    failed.set_exception(KeyError("k"))
    timer = threading.Timer(0.2, slow.set_result, args=(5,))
    timer.start()
    with pytest.raises(KeyError, match="k"):
        hg_futures.wait_all([slow, failed])
    assert slow.done()
    timer.join()


def test_wait_all_timeout_bounds_the_whole_wait():
    done, pending = Future(), Future()
    done.set_result(1)
    with pytest.raises(hg_futures.FutureTimeoutError, match="timed out"):
        hg_futures.wait_all([done, pending], timeout=0.05)


def test_collect_all_drives_futures_whose_waiter_makes_progress():
    """A Work's future completes only when someone drives it (wait_fn); waiting on the
    combined future must drive it, not block forever."""
    driven = Future(wait_fn=lambda: driven.set_result(7))
    combined = hg_futures.collect_all([driven])
    assert [f.wait() for f in combined.wait(WAIT)] == [7]
    driven = Future(wait_fn=lambda: driven.set_result(8))
    assert hg_futures.wait_all([driven], timeout=WAIT) == [8]


@pytest.mark.parametrize("api", ["collect_all", "wait_all"])
def test_only_futures_are_accepted(api):
    with pytest.raises(TypeError, match=rf"{api}\(\) expects a list of Futures, got int at index 1"):
        getattr(hg_futures, api)([Future(), 3])
    with pytest.raises(TypeError, match=rf"{api}\(\) expects a list of Futures, got int"):
        getattr(hg_futures, api)(3)
