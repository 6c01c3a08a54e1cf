"""Ports of PyTorch's TestAutograd grad-mode tests: no_grad, enable_grad, set_grad_enabled.

Left out: test_no_grad_modifies_version and test_no_grad_assignment (in-place ops and version
counters), TestAutogradInferenceMode (hpcgrad builds no inference tensors), and forward-mode AD.
"""

import asyncio
import threading
import warnings

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, grad_mode

from autograd_helpers import leaf


@pytest.fixture(autouse=True)
def grad_mode_restored():
    """Every test starts with grad enabled and must leave it as it found it."""
    assert hg.is_grad_enabled()
    yield
    enabled = hg.is_grad_enabled()
    hg.set_grad_enabled(True)
    assert enabled, "the test left grad mode disabled"


def assert_grad_mode(expected):
    assert hg.is_grad_enabled() is expected


def assert_records_no_graph(t):
    assert not t.requires_grad
    assert t.grad_fn is None
    with pytest.raises(RuntimeError):
        t.backward(hg.ones(*t.shape))


# --- decorators and context managers ----------------------------------------------------------

def test_no_grad():
    x = hg.ones(5, 5, requires_grad=True)
    y = hg.ones(5, 5) * 4
    with hg.no_grad():
        w = x + y

    def adder(a, b):
        return a + b

    for wrapped in (hg.no_grad()(adder), hg.no_grad(adder)):
        z = wrapped(x, y)
        assert_records_no_graph(w)
        assert_records_no_graph(z)
        assert_grad_mode(True)

    # nested decorator and with-statement
    with hg.no_grad():
        assert_grad_mode(False)
        wrapped(x, y)
        assert_grad_mode(False)


@pytest.mark.parametrize("mode", ["enable_grad", "no_grad"])
def test_enable_grad_decorator_no_paren(mode):
    """``@enable_grad`` (and ``@no_grad``) without parentheses decorate the function itself."""
    x = hg.ones(1, requires_grad=True)
    decorator = getattr(hg, mode)

    @decorator
    def doubler(t):
        return t * 2

    outer = hg.no_grad() if mode == "enable_grad" else hg.enable_grad()
    with outer:
        z = doubler(x)
    assert z.requires_grad is (mode == "enable_grad")
    assert doubler.__name__ == "doubler"


def test_no_grad_python_function():
    """Python Functions respect grad mode."""
    x = hg.ones(5, 5, requires_grad=True)

    class MyOp(Function):
        @staticmethod
        def forward(ctx, t):
            return t.array + 1

        @staticmethod
        def backward(ctx, dy):
            return dy

    with hg.no_grad():
        y = MyOp.apply(x)
    assert not y.requires_grad


def test_set_grad_enabled():
    x = hg.tensor([1.0], requires_grad=True)
    with hg.set_grad_enabled(False):
        y = x * 2
    assert not y.requires_grad
    with hg.set_grad_enabled(True):
        y = x * 2
    assert y.requires_grad
    with hg.set_grad_enabled(False):
        hg.set_grad_enabled(True)
        y = x * 2
    assert y.requires_grad


def test_set_grad_enabled_as_function_and_decorator():
    """A call acts at once; as a decorator only calls of the function change the mode."""
    hg.set_grad_enabled(False)
    assert_grad_mode(False)
    hg.set_grad_enabled(True)
    assert_grad_mode(True)

    @hg.set_grad_enabled(False)
    def inside():
        return hg.is_grad_enabled()

    assert_grad_mode(True)  # building the decorator did not leave the mode off
    assert inside() is False
    assert_grad_mode(True)
    with hg.no_grad():
        assert hg.set_grad_enabled(True)(hg.is_grad_enabled)() is True
        assert_grad_mode(False)


def test_set_grad_enabled_clone():
    for mode in (False, True):
        with hg.set_grad_enabled(True):
            ctx = hg.set_grad_enabled(mode)
            cloned = ctx.clone()
            assert cloned is not ctx
            assert isinstance(cloned, hg.set_grad_enabled)
            assert cloned.mode is mode
        assert_grad_mode(True)
    assert "mode=False" in repr(hg.set_grad_enabled(False).clone())
    hg.set_grad_enabled(True)


def test_set_grad_generator_functions_recursive():
    """Decorators and with-blocks calling each other restore the caller's setting."""

    @hg.enable_grad()
    def enable_grad_decorator_recursive(depth):
        assert_grad_mode(True)
        if depth > 0:
            no_grad_decorator_recursive(depth - 1)
            assert_grad_mode(True)

    @hg.no_grad()
    def no_grad_decorator_recursive(depth):
        assert_grad_mode(False)
        if depth > 0:
            enable_grad_decorator_recursive(depth - 1)
            assert_grad_mode(False)

    def enable_grad_context_manager_recursive(depth):
        with hg.enable_grad():
            assert_grad_mode(True)
            if depth > 0:
                no_grad_context_manager_recursive(depth - 1)
                assert_grad_mode(True)

    def no_grad_context_manager_recursive(depth):
        with hg.no_grad():
            assert_grad_mode(False)
            if depth > 0:
                enable_grad_context_manager_recursive(depth - 1)
                assert_grad_mode(False)

    for outer, mode in ((hg.enable_grad, True), (hg.no_grad, False)):
        with outer():
            assert_grad_mode(mode)
            enable_grad_decorator_recursive(10)
            assert_grad_mode(mode)
            enable_grad_context_manager_recursive(10)
            assert_grad_mode(mode)


def test_decorating_a_class_wraps_its_constructor_with_a_warning():
    class Recorder:
        def __init__(self):
            self.enabled = hg.is_grad_enabled()

    with pytest.warns(FutureWarning, match="Decorating classes is deprecated"):
        made = hg.no_grad()(Recorder)
    assert made().enabled is False
    assert_grad_mode(True)


# --- generators: the mode holds while the generator runs, the caller's while it is suspended ----

def both_generators(body):
    """``body`` decorated by no_grad (expects False inside) and enable_grad (expects True)."""
    return ((hg.no_grad()(body(False)), hg.enable_grad, True),
            (hg.enable_grad()(body(True)), hg.no_grad, False))


def test_set_grad_generator_functions():
    def body(inside):
        def gen():
            for i in range(10):
                assert_grad_mode(inside)
                yield i
        return gen

    for gen, outer, outside in both_generators(body):
        with outer():
            seen = []
            for i in gen():
                assert_grad_mode(outside)
                seen.append(i)
            assert seen == list(range(10))


@pytest.mark.parametrize("mode", [False, True])
def test_set_grad_enabled_decorates_generator(mode):
    """``@set_grad_enabled(mode)`` (a one-shot manager) holds the mode at every resumption."""

    @hg.set_grad_enabled(mode)
    def gen():
        for i in range(3):
            assert_grad_mode(mode)
            yield i

    outside = not mode
    with hg.set_grad_enabled(outside):
        for _ in gen():
            assert_grad_mode(outside)
        assert_grad_mode(outside)


def test_set_grad_coroutines():
    def body(inside):
        def coro(n=10):
            assert_grad_mode(inside)
            for i in range(n):
                assert_grad_mode(inside)
                r = yield i
                assert_grad_mode(inside)
                assert r == i
            assert_grad_mode(inside)
            return "done"
        return coro

    for coro_fn, outer, outside in both_generators(body):
        with outer():
            coro, r = coro_fn(), None
            with pytest.raises(StopIteration) as stop:
                while True:
                    assert_grad_mode(outside)
                    r = coro.send(r)
                    assert_grad_mode(outside)
            assert stop.value.value == "done"  # the generator's return value comes through


class RecoverableException(Exception):
    pass


class UnrecoverableException(Exception):
    pass


class SecondaryException(Exception):
    pass


def test_set_grad_coroutines_benign_exceptions():
    def body(inside):
        def coro(n=10):
            has_raised = False
            for i in range(n):
                try:
                    assert_grad_mode(inside)
                    yield (-i if has_raised else i)
                except RecoverableException:
                    assert_grad_mode(inside)
                    has_raised = True
        return coro

    for coro_fn, outer, outside in both_generators(body):
        with outer():
            coro = coro_fn()
            assert next(coro) == 0
            thrown = 0
            with pytest.raises(StopIteration):
                while True:
                    r = coro.throw(RecoverableException)
                    assert_grad_mode(outside)
                    assert r < 0
                    thrown += 1
            assert thrown == 9


def test_set_grad_coroutines_critical_exceptions():
    def body(inside):
        def coro(n=10):
            for i in range(n):
                try:
                    assert_grad_mode(inside)
                    yield i
                except UnrecoverableException:
                    assert_grad_mode(inside)
                    raise SecondaryException from None
        return coro

    for coro_fn, outer, outside in both_generators(body):
        with outer():
            coro = coro_fn()
            assert next(coro) == 0
            with pytest.raises(SecondaryException):
                coro.throw(UnrecoverableException)
            assert_grad_mode(outside)


def test_set_grad_coroutines_exit():
    def body(inside):
        def coro(state):
            for i in range(10):
                try:
                    assert_grad_mode(inside)
                    yield i
                except GeneratorExit:
                    assert_grad_mode(inside)
                    state.add("GeneratorExit")
                    raise
        return coro

    for coro_fn, outer, outside in both_generators(body):
        state = set()
        with outer():
            coro = coro_fn(state)
            for _ in range(5):
                next(coro)
            coro.close()
            assert_grad_mode(outside)
        assert "GeneratorExit" in state


def test_async_coroutine_function_runs_under_the_mode():
    """``async def`` too: the mode holds at every step of the coroutine, not in the event loop."""
    seen = []

    @hg.no_grad()
    async def work():
        seen.append(hg.is_grad_enabled())
        await asyncio.sleep(0)
        seen.append(hg.is_grad_enabled())
        return hg.ones(1, requires_grad=True) * 2

    async def main():
        task = asyncio.ensure_future(work())
        await asyncio.sleep(0)
        seen.append(("loop", hg.is_grad_enabled()))
        return await task

    out = asyncio.run(main())
    assert seen == [False, ("loop", True), False]
    assert not out.requires_grad


def test_async_generator_function_is_refused_at_decoration():
    async def agen():
        yield 1

    with pytest.raises(TypeError, match="async generator"):
        hg.no_grad()(agen)


# --- grad mode and backward ----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_grad_mode_restored_reentrant():
    """A backward that enables grad and runs a nested grad() gets its own mode back after."""

    class MyFunction(Function):
        @staticmethod
        def forward(ctx, inp):
            return inp.array.copy()

        @staticmethod
        def backward(ctx, go):
            original = hg.is_grad_enabled()
            with hg.enable_grad():
                assert_grad_mode(True)
                foo = hg.tensor(np.random.default_rng(0).random(go.shape), requires_grad=True)
                (g,) = hg.autograd.grad(foo ** 3, foo, grad_outputs=go)
                assert_grad_mode(True)
            assert hg.is_grad_enabled() == original
            seen.append(original)
            return g

    seen = []
    inp = leaf(np.random.default_rng(1).random(3))
    MyFunction.apply(inp).sum().backward()  # original == False
    MyFunction.apply(inp).sum().backward(create_graph=True)  # original == True
    assert seen == [False, True]


def test_grad_mode_is_thread_local():
    """A thread's mode is its own: no_grad in one thread does not reach another."""
    ready, release = threading.Event(), threading.Event()
    seen = {}

    def other():
        seen["start"] = hg.is_grad_enabled()  # a new thread starts with grad enabled
        with hg.no_grad():
            ready.set()
            release.wait(timeout=10)
            seen["inside"] = hg.is_grad_enabled()

    with hg.no_grad():
        t = threading.Thread(target=other)
        t.start()
        assert ready.wait(timeout=10)
        hg.set_grad_enabled(True)  # this thread only
        assert_grad_mode(True)
        release.set()
        t.join(timeout=10)
    assert not t.is_alive()
    assert seen == {"start": True, "inside": False}


def test_no_grad_function_decorator_per_call_state():
    """One decorated function called from two threads at once: each call has its own state."""
    barrier = threading.Barrier(2, timeout=10)
    results = []

    @hg.no_grad
    def inside():
        barrier.wait()
        mode = hg.is_grad_enabled()
        barrier.wait()
        return mode

    def run():
        results.append((inside(), hg.is_grad_enabled()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [(False, True), (False, True)]


def test_module_attributes_mirror_torch():
    """The names PyTorch users reach for exist where they expect them."""
    assert hg.autograd.no_grad is grad_mode.no_grad is hg.no_grad
    assert hg.autograd.set_grad_enabled is hg.set_grad_enabled
    assert hg.autograd.is_grad_enabled is hg.is_grad_enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(hg.no_grad(), hg.no_grad)  # no argument: an instance, no warning
