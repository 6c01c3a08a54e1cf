"""rpc.functions.async_execution: a remote function that returns a Future, replied to when it completes.

Note [Async execution]
    A function decorated with ``@rpc.functions.async_execution`` returns a Future (hpcgrad's one
    Future: ``rpc.rpc_async(...)``, ``fut.then(...)``, ``hpcgrad.futures.Future()``). Called
    through ``rpc_sync``/``rpc_async``/``remote`` (or an RRef proxy whose method is decorated),
    the callee runs it, hooks the reply onto the Future and returns: the serving thread is free
    at once, and the reply goes out when the Future completes, on the thread that completes it,
    with its value encoded exactly as a normal reply (in the request's codec scope: a tensor that
    requires grad joins the request's autograd context), or its exception as the remote error.
    Until then the reply counts as the rank's outstanding work, so a graceful ``rpc.shutdown()``
    waits for it (Note [Quiet shutdown] in agent.py). As PyTorch's, the decorator only marks the
    function (``_wrapped_async_rpc_function``); calling it locally returns the Future itself.
    With ``@staticmethod``/``@classmethod`` it must be the inner decorator (the mark is read
    through the static/class/bound method). A Future that only completes when someone waits on
    it (a Work's, driven by its waiter) never completes here: return one that its producer
    completes (an RPC's, a ``then`` of one, or one you ``set_result`` yourself).
"""

import functools

from hpcgrad.base.futures import Future


def async_execution(fn):
    """Mark ``fn`` (which must return a Future) to run asynchronously on the RPC callee: the
    callee replies when the returned Future completes, holding no thread meanwhile (Note
    [Async execution]). As PyTorch's, inner to ``@staticmethod``/``@classmethod``::

        @rpc.functions.async_execution
        def async_add_chained(to, x, y, z):
            return rpc.rpc_async(to, hpcgrad.add, args=(x, y)).then(lambda fut: fut.wait() + z)
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    wrapper._wrapped_async_rpc_function = fn
    return wrapper


def is_async(func):
    """Whether ``func`` (a function, or a static/class/bound method of one) was decorated with
    ``async_execution``."""
    try:
        return getattr(func, "_wrapped_async_rpc_function", None) is not None
    except Exception:  # noqa: BLE001  (an object whose __getattr__ raises something odd)
        return False


class AsyncResult:
    """What an RRef proxy's call on the owner returns when the method is ``async_execution``:
    the Future to reply with (Note [RRef proxies] in rpc/__init__.py)."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


def future_of(func, result):
    """The Future to reply with when ``func`` was an async call (``result``: what it
    returned), else None. A decorated function that returned no Future is PyTorch's error."""
    if isinstance(result, AsyncResult):
        return result.future
    if not is_async(func):
        return None
    return checked_future(func, result)


def checked_future(func, result):
    """``result``, which the async function ``func`` returned, checked to be a Future."""
    if not isinstance(result, Future):
        name = getattr(func, "__qualname__", None) or repr(func)
        raise RuntimeError(
            f"Async functions must return an IValue of Future type, but got "
            f"{type(result).__name__}: {name} is decorated with @rpc.functions.async_execution, "
            f"so it must return an hpcgrad.futures.Future (rpc.rpc_async(...), fut.then(...), "
            f"or a Future() it completes later); return the value itself from an undecorated "
            f"function instead")
    return result
