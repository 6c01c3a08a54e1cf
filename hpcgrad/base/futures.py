"""Future: the one type for every pending result in hpcgrad (Work, RPC replies, backward passes).

Note [One Future]: PyTorch has one ``torch.futures.Future`` for collectives, RPCs and
distributed autograd; hpcgrad had three with different rules (one raised on a second set, one
ignored it, one was ``concurrent.futures``). The rules here, for all of them:

- set once: a second ``set_result``/``set_exception`` raises. Producers that race each other (a
  reply against its timeout) use ``try_set_result``/``try_set_exception``, which say whether
  they won;
- callbacks run after the value is stored, outside the lock, on the thread that completed the
  future (or at once, on the caller's, if it is already done); a callback's exception is reported
  through ``sys.unraisablehook`` and never stops the other callbacks;
- ``then(fn)`` returns a future of ``fn(self)``: an error raised by ``fn`` (including one re-raised
  by ``self.wait()`` inside it) completes the chained future with that error;
- ``wait(timeout)`` drives the producer when one was given (``wait_fn``: a Work that must test its
  MPI requests), else blocks; past ``timeout`` it raises ``timeout_error``.

This module sits below every other one: it imports nothing of hpcgrad.
"""

import sys
import threading
import time
import types


class FutureTimeoutError(TimeoutError):
    """``Future.wait(timeout)`` ran out of time before the future completed."""


class Future:
    """The eventual value (or error) of an operation, as ``torch.futures.Future``."""

    __class_getitem__ = classmethod(types.GenericAlias)  # ``Future[Tensor]`` in annotations
    timeout_error = FutureTimeoutError  # subclasses raise their own type (RpcTimeoutError)

    def __init__(self, wait_fn=None, describe=""):
        self._wait_fn = wait_fn      # drives completion from the waiting thread, once
        self.describe = describe     # names the operation in timeout messages
        self._lock = threading.Lock()
        self._done = False
        # made by the first thread that blocks in wait(): most futures are completed before
        # anyone waits, or waited on by a thread that receives their reply itself, and an
        # Event (a Condition and its lock) cost more than the rest of the future
        self._event = None
        self._value = self._error = None
        self._callbacks = []

    def __repr__(self):
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        what = f" of {self.describe}" if self.describe else ""
        return f"<{type(self).__name__}{what}, {state}>"

    # --- completing ---------------------------------------------------------------------------
    def set_result(self, value):
        if not self._complete(value, None):
            raise RuntimeError(f"Future can only be marked completed once: {self!r} is already "
                               "completed (set_result)")

    def set_exception(self, error):
        if not isinstance(error, BaseException):
            raise TypeError(f"set_exception expects an exception, got {type(error).__name__}")
        if not self._complete(None, error):
            raise RuntimeError(f"Future can only be marked completed once: {self!r} is already "
                               "completed (set_exception)")

    def try_set_result(self, value):
        """``set_result`` unless already completed; True when this call completed it."""
        return self._complete(value, None)

    def try_set_exception(self, error):
        """``set_exception`` unless already completed; True when this call completed it."""
        return self._complete(None, error)

    def _complete(self, value, error):
        with self._lock:
            if self._done:
                return False
            self._value, self._error = value, error
            self._done = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, []
        if event is not None:
            event.set()
        for callback in callbacks:
            self._run(callback)
        return True

    def _run(self, callback):
        try:
            callback(self)
        except BaseException as exc:  # one failing callback must not starve the others
            sys.unraisablehook(types.SimpleNamespace(
                exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__,
                err_msg=f"Exception in a callback of {self!r}", object=callback))

    # --- reading ------------------------------------------------------------------------------
    def done(self):
        return self._done

    def _wait_done(self, timeout):
        """Block until completed or ``timeout`` s passed; whether it completed."""
        if self._done:
            return True
        with self._lock:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def wait(self, timeout=None):
        """The value once completed (raises its error); ``timeout`` in seconds bounds the wait."""
        if not self._done and self._wait_fn is not None:
            wait_fn, self._wait_fn = self._wait_fn, None
            wait_fn()
            if not self._done and timeout is None:
                raise RuntimeError(f"{self!r}: its producer returned without completing it")
        if not self._wait_done(timeout):
            raise self.timeout_error(f"{self.describe or 'Future'} timed out after {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._value

    result = wait  # concurrent.futures' name

    def value(self):
        """The value of a completed future (raises its error); RuntimeError if still pending."""
        if not self._done:
            raise RuntimeError(f"{self!r}: value() before completion; call wait()")
        return self.wait()

    def exception(self, timeout=None):
        """The error it completed with, or None; waits for completion like ``wait``."""
        try:
            self.wait(timeout)
        except self.timeout_error:
            raise
        except BaseException:
            pass
        return self._error

    # --- chaining -----------------------------------------------------------------------------
    def add_done_callback(self, callback):
        """``callback(self)`` once completed: now, on this thread, if it already is."""
        if not callable(callback):
            raise TypeError(f"add_done_callback() expects a callable, got {type(callback).__name__}")
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        self._run(callback)

    def _chained(self):
        """The future ``then`` returns: same type, driven by this one's producer."""
        return type(self)(wait_fn=self.wait if self._wait_fn is not None else None,
                          describe=self.describe)

    def then(self, callback):
        """A future of ``callback(self)``, run when this one completes; errors carry over."""
        if not callable(callback):
            raise TypeError(f"then() expects a callable, got {type(callback).__name__}")
        chained = self._chained()

        def run(fut):
            try:
                chained.set_result(callback(fut))
            except BaseException as exc:
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained


def _future_list(futures, what):
    """``futures`` as a list, each checked to be a Future (PyTorch refuses anything else)."""
    try:
        futures = list(futures)
    except TypeError:
        raise TypeError(f"{what}() expects a list of Futures, got {type(futures).__name__}") from None
    for i, fut in enumerate(futures):
        if not isinstance(fut, Future):
            raise TypeError(f"{what}() expects a list of Futures, got {type(fut).__name__} at "
                            f"index {i} (a Work's future is work.get_future())")
    return futures


def collect_all(futures):
    """A future of the list of ``futures``, completed once all of them are (PyTorch's).

    As PyTorch's, if any of them failed the combined future fails, once all are done, with the
    error of the first failed one in list order. Waiting on it drives the producers of futures
    that need their waiter to make progress (a Work's MPI requests), so it never waits on a
    request nobody tests.
    """
    futures = _future_list(futures, "collect_all")
    driven = [fut for fut in futures if fut._wait_fn is not None]

    def drive():  # their errors are the combined future's, set by the last callback
        for fut in driven:
            try:
                fut.wait()
            except BaseException:  # noqa: BLE001  (reported through the combined future)
                pass

    combined = Future(wait_fn=drive if driven else None,
                      describe=f"collect_all of {len(futures)}")
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        combined.set_result([])
        return combined

    def one_done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if not last:
            return
        for fut in futures:
            if fut._error is not None:
                combined.set_exception(fut._error)
                return
        combined.set_result(futures)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def wait_all(futures, timeout=None):
    """The values of ``futures``, in order, once all are complete (PyTorch's ``wait_all``).

    As PyTorch's, it waits for every one of them, then raises the error of the first failed
    one in list order. ``timeout`` (hpcgrad's; seconds, None: none) bounds the whole wait.
    """
    futures = _future_list(futures, "wait_all")
    deadline = None if timeout is None else time.monotonic() + timeout
    values, error = [], None
    for fut in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            values.append(fut.wait(left))
        except BaseException as exc:  # noqa: BLE001  (the first is raised once all are done)
            if not fut.done():  # this wait ran out of time (or was interrupted)
                raise
            if error is None:
                error = exc
    if error is not None:
        raise error
    return values
