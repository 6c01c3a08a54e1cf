"""The one waiting policy (Note [One waiting policy] in hpcgrad/comm/waiting.py): what a
polling thread does between polls, on a fake clock (no timing in the assertions)."""

import os

import pytest

from hpcgrad.comm import waiting


class Recorder(list):
    """A fake clock and core for one Backoff: each pause as ("yield",) or ("sleep", seconds),
    instead of yielding or sleeping (other threads of the process keep the real ones)."""

    def monotonic(self):
        return 0.0

    def sleep(self, seconds):
        self.append(("sleep", seconds))

    def yield_core(self):
        self.append(("yield",))


@pytest.fixture
def pauses():
    return Recorder()


def backoff(pauses, **kwargs):
    return waiting.Backoff(clock=pauses, yield_core=pauses.yield_core, **kwargs)


def recorded(pauses, made):
    """A Backoff made by one of waiting's factories, pausing into ``pauses``."""
    made._sleep, made._yield = pauses.sleep, pauses.yield_core
    return made


def run(backoff, times, deadline=None):
    for now in times:
        backoff.pause(now, deadline)


def test_yields_in_the_window_then_sleeps_short_then_doubles_to_the_cap(pauses):
    b = backoff(pauses, yield_seconds=0.5e-3, spin_seconds=2e-3, longest=lambda q: 1e-4)
    b.restart(0.0)
    run(b, [0.0, 0.4e-3])
    assert pauses == [("yield",), ("yield",)]
    pauses.clear()
    run(b, [0.6e-3, 1.9e-3])  # past the window, within the spin: the first sleep, unchanged
    assert pauses == [("sleep", waiting.FIRST_SLEEP)] * 2
    pauses.clear()
    run(b, [2.1e-3 + i * 1e-4 for i in range(6)])  # doubling, capped at longest(quiet)
    assert [s for _, s in pauses] == pytest.approx([2e-5, 4e-5, 8e-5, 1e-4, 1e-4, 1e-4])


def test_restart_starts_over_and_a_deadline_shortens_the_sleep(pauses):
    b = backoff(pauses, yield_seconds=0.0, spin_seconds=0.0, longest=lambda q: 1.0)
    b.restart(0.0)
    run(b, [1.0, 2.0, 3.0])
    assert [s for _, s in pauses] == pytest.approx([2e-5, 4e-5, 8e-5])
    pauses.clear()
    b.restart(10.0)
    assert b.quiet(10.5) == pytest.approx(0.5)
    run(b, [10.5], deadline=10.5 + 1e-6)
    assert pauses == [("sleep", pytest.approx(1e-6))]
    pauses.clear()
    run(b, [11.0], deadline=10.0)  # a deadline already past: no negative sleep
    assert pauses == [("sleep", 0.0)]


def test_the_three_waits_numbers():
    """The measured numbers each Note names, in one place."""
    collective = waiting.collective()
    assert collective.yield_seconds == 0.05
    assert collective.longest(0.1) == pytest.approx(2e-4)  # 0.2% of the time waited
    assert collective.longest(10.0) == 1e-3
    waiter = waiting.rpc_waiter(5e-4)
    assert (waiter.yield_seconds, waiter.spin_seconds) == (5e-4, 2e-3)
    assert waiter.longest(0.05) == 1e-4 and waiter.longest(0.2) == 5e-4
    progress = waiting.rpc_progress()
    assert progress.yield_seconds == 0.0 and progress.longest(1.0) == 5e-4
    cores = os.cpu_count() or 1
    assert waiting.rpc_yield_seconds(cores) == 5e-4
    assert waiting.rpc_yield_seconds(cores + 1) == 0.0


def test_the_collective_wait_sleeps_once_a_peer_is_late(pauses):
    b = recorded(pauses, waiting.collective())
    b.restart(0.0)
    run(b, [0.01, 0.049])
    assert pauses == [("yield",), ("yield",)]
    pauses.clear()
    run(b, [0.06 + i for i in range(12)])
    sleeps = [s for _, s in pauses]
    assert all(kind == "sleep" for kind, *_ in pauses)
    assert sleeps == sorted(sleeps) and sleeps[-1] == 1e-3
