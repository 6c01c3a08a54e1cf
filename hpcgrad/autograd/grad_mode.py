"""Grad mode (thread-local, like PyTorch's) and anomaly mode (process-wide)."""

import functools
import threading


class _GradState(threading.local):
    enabled = True


_state = _GradState()


def is_grad_enabled():
    return _state.enabled


def _set_enabled(mode):
    _state.enabled = bool(mode)


class _GradModeContext:
    """Base for context managers that also work as decorators."""

    mode = True

    def __enter__(self):
        self._prev = _state.enabled
        _state.enabled = self.mode

    def __exit__(self, *exc):
        _state.enabled = self._prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__(*self._ctor_args()):
                return fn(*args, **kwargs)
        return wrapper

    def _ctor_args(self):
        return ()


class no_grad(_GradModeContext):
    """Operations inside record no graph: results never require grad."""

    mode = False


class enable_grad(_GradModeContext):
    """Re-enable graph recording inside a ``no_grad`` block."""

    mode = True


class set_grad_enabled(_GradModeContext):
    """``set_grad_enabled(False)`` acts at once (as a call) and as a context manager."""

    def __init__(self, mode):
        self.mode = bool(mode)
        self._prev = _state.enabled
        _state.enabled = self.mode

    def __enter__(self):
        pass

    def __call__(self, fn):
        _state.enabled = self._prev  # used as a decorator: only calls of fn change the mode
        return super().__call__(fn)

    def _ctor_args(self):
        return (self.mode,)


class _AnomalyState:
    enabled = False
    check_nan = True


_anomaly = _AnomalyState()


def is_anomaly_enabled():
    return _anomaly.enabled


def is_anomaly_check_nan_enabled():
    return _anomaly.check_nan


class detect_anomaly:
    """Record each Node's forward stack and raise when a backward Node returns NaN.

    Slow: every op captures a Python stack. Use it to find where a NaN came from, then turn it off.
    """

    def __init__(self, check_nan=True):
        self.check_nan = check_nan

    def __enter__(self):
        self._prev = (_anomaly.enabled, _anomaly.check_nan)
        _anomaly.enabled, _anomaly.check_nan = True, self.check_nan

    def __exit__(self, *exc):
        _anomaly.enabled, _anomaly.check_nan = self._prev
        return False


def set_detect_anomaly(mode, check_nan=True):
    _anomaly.enabled, _anomaly.check_nan = bool(mode), bool(check_nan)
