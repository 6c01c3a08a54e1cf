"""The one progress loop (hpcgrad/comm/progress.py ProgressLoop): what it does with each outcome
of its step, woken by events, never by timing."""

import threading

from hpcgrad.comm import progress


class RecordingBackoff:
    def __init__(self):
        self.calls = []

    def restart(self, now):
        self.calls.append("restart")

    def pause(self, now, deadline=None):
        self.calls.append("pause")
        return 0.0


def test_each_outcome_of_a_step():
    """True: restart, then pause; False: pause; a number: that sleep, no pause; None: wait for
    wake() (restarting); stop() ends the thread."""
    outcomes = iter([True, False, 1e-4, None, False])
    backoff = RecordingBackoff()
    idle, finished = threading.Event(), threading.Event()
    steps = []

    def step():
        outcome = next(outcomes, "done")
        steps.append(outcome)
        if outcome is None:
            idle.set()
        if outcome == "done":
            finished.set()
            return None
        return outcome

    loop = progress.ProgressLoop("test-progress-loop", step, backoff).start()
    try:
        assert idle.wait(10), steps
        assert backoff.calls == ["restart", "pause", "pause"]  # the number slept by itself
        assert not finished.is_set()
        loop.wake()
        assert finished.wait(10), steps
        assert backoff.calls == ["restart", "pause", "pause", "restart", "pause"]
        assert loop.polls == 4  # idle turns are not polls
    finally:
        loop.stop()
    assert not loop._thread.is_alive()


def test_the_communication_progress_thread_tests_what_it_watches():
    """ProgressThread on the loop: a watched Work is tested until it completes, then the thread
    idles until the next watch."""
    tested = threading.Event()

    class FakeWork:
        _completed = False

        def is_completed(self):
            self._completed = True
            tested.set()
            return True

    thread = progress.ProgressThread(interval=1e-4)
    try:
        work = thread.watch(FakeWork())
        assert tested.wait(10)
        assert work._completed
        for _ in range(1000):  # the round that saw it complete drops it from the list
            if not thread.pending() and not thread._pending:
                break
            threading.Event().wait(0.01)
        assert thread.pending() == [] and thread.stats()["polls"] >= 1
    finally:
        thread.stop()
