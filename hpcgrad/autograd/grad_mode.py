"""Grad mode (thread-local, like PyTorch's) and anomaly mode (process-wide)."""

import functools
import inspect
import threading
import warnings


class _GradState(threading.local):
    enabled = True


_state = _GradState()


def is_grad_enabled():
    """Whether operations on this thread record a graph (each thread has its own mode)."""
    return _state.enabled


def _set_enabled(mode):
    _state.enabled = bool(mode)


# Note [Grad mode in generators and coroutines]
# A decorated generator (or coroutine) does not run when it is called, but at each next(),
# send() or throw(); between two of them it is suspended and the caller runs. So the mode is
# set around each resumption and restored at each yield (as PyTorch's _wrap_generator does),
# with a fresh context manager each time (one-shot managers such as set_grad_enabled capture
# the mode to restore when they are made). `async def` functions are driven the same way
# through their awaitable. Async generators are refused at decoration rather than silently
# run under the caller's mode.

def _drive(ctx_factory, gen):
    """Run generator or coroutine ``gen`` one step at a time, each step under ``ctx_factory()``."""
    try:
        with ctx_factory():
            response = gen.send(None)
        while True:
            try:
                request = yield response
            except GeneratorExit:
                with ctx_factory():
                    gen.close()
                raise
            except BaseException as exc:  # thrown in by the caller: pass it on to gen
                with ctx_factory():
                    response = gen.throw(exc)
            else:
                with ctx_factory():
                    response = gen.send(request)
    except StopIteration as stop:
        return stop.value


class _ModeAwaitable:
    """``await`` on it runs the wrapped coroutine one step at a time under the mode."""

    __slots__ = ("_ctx_factory", "_coroutine")

    def __init__(self, ctx_factory, coroutine):
        self._ctx_factory, self._coroutine = ctx_factory, coroutine

    def __await__(self):
        return (yield from _drive(self._ctx_factory, self._coroutine.__await__()))


def _context_decorator(ctx_factory, func):
    """``func`` wrapped so each of its calls (and each step of a generator) runs in the mode."""
    if inspect.isasyncgenfunction(func):
        raise TypeError(f"cannot decorate async generator function {func.__qualname__!r} with a "
                        "grad mode (its steps would run in the caller's mode); use `with "
                        "no_grad():` (or enable_grad/set_grad_enabled) inside its body instead")
    if inspect.isgeneratorfunction(func):
        @functools.wraps(func)
        def generator_context(*args, **kwargs):
            return (yield from _drive(ctx_factory, func(*args, **kwargs)))
        return generator_context
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def coroutine_context(*args, **kwargs):
            return await _ModeAwaitable(ctx_factory, func(*args, **kwargs))
        return coroutine_context

    @functools.wraps(func)
    def decorate_context(*args, **kwargs):
        with ctx_factory():
            return func(*args, **kwargs)
    return decorate_context


class _DecoratorContextManager:
    """A grad-mode context manager that also decorates functions, generators and coroutines."""

    def __call__(self, orig_func):
        if inspect.isclass(orig_func):
            warnings.warn("Decorating classes is deprecated and will be disabled in future "
                          "versions. You should only decorate functions or methods. To preserve "
                          "the current behavior of class decoration, you can directly decorate "
                          "the `__init__` method and nothing else.", FutureWarning, stacklevel=2)
            cls = orig_func
            func = lambda *args, **kwargs: cls(*args, **kwargs)  # noqa: E731
        else:
            func = orig_func
        return _context_decorator(self.clone, func)

    def clone(self):
        """A new manager of the same mode (a decorator enters a fresh one per call)."""
        return self.__class__()


class _NoParamDecoratorContextManager(_DecoratorContextManager):
    """Also a decorator without parentheses: ``@no_grad`` and ``no_grad(fn)``."""

    def __new__(cls, orig_func=None):
        if orig_func is None:
            return super().__new__(cls)
        return cls()(orig_func)


class no_grad(_NoParamDecoratorContextManager):
    """Operations inside record no graph: results never require grad.

    A context manager, or a decorator with or without parentheses; in a decorated generator
    or coroutine it holds while the body runs, not while it is suspended. Thread-local.
    """

    def __init__(self, orig_func=None):
        self.prev = False

    def __enter__(self):
        self.prev = _state.enabled
        _state.enabled = False

    def __exit__(self, *exc):
        _state.enabled = self.prev
        return False


class enable_grad(_NoParamDecoratorContextManager):
    """Re-enable graph recording inside a ``no_grad`` block (same forms as ``no_grad``)."""

    def __init__(self, orig_func=None):
        self.prev = False

    def __enter__(self):
        self.prev = _state.enabled
        _state.enabled = True

    def __exit__(self, *exc):
        _state.enabled = self.prev
        return False


class set_grad_enabled(_DecoratorContextManager):
    """``set_grad_enabled(mode)`` sets the mode at once (a call), until the end of a ``with``
    block (a context manager), or during each call of a function (a decorator)."""

    def __init__(self, mode):
        self.prev = _state.enabled
        self.mode = bool(mode)
        _state.enabled = self.mode

    def __call__(self, orig_func):
        _state.enabled = self.prev  # used as a decorator: only calls of fn change the mode
        return super().__call__(orig_func)

    def __enter__(self):
        _state.enabled = self.mode

    def __exit__(self, *exc):
        _state.enabled = self.prev
        return False

    def __repr__(self):
        return f"{type(self).__module__}.{type(self).__qualname__}(mode={self.mode})"

    def clone(self):
        return self.__class__(self.mode)


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
        warnings.warn("Anomaly Detection has been enabled. This mode will increase the runtime "
                      "and should only be enabled for debugging.", stacklevel=2)

    def __enter__(self):
        self._prev = (_anomaly.enabled, _anomaly.check_nan)
        _anomaly.enabled, _anomaly.check_nan = True, self.check_nan

    def __exit__(self, *exc):
        _anomaly.enabled, _anomaly.check_nan = self._prev
        return False


def set_detect_anomaly(mode, check_nan=True):
    _anomaly.enabled, _anomaly.check_nan = bool(mode), bool(check_nan)
