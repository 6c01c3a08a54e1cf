"""Saved-tensor hooks: ``pack`` what forward saves for backward, ``unpack`` it when backward reads it.

PyTorch's ``torch.autograd.graph.saved_tensors_hooks``: while the context is active, every tensor
an op saves (``ctx.save_for_backward``, built-in ops included) goes through ``pack_hook(tensor) ->
anything``; ``ctx.saved_tensors`` calls ``unpack_hook(packed) -> Tensor`` on each read. The
innermost active pair applies. Hooks are thread-local, as grad mode is. Non-reentrant activation
checkpointing (hpcgrad.utils.checkpoint) is built on them.
"""

import threading
import weakref


class _HookState(threading.local):
    stack = ()          # (pack, unpack) pairs, innermost last; a tuple so a thread starts empty
    disabled = None     # message of an active disable_saved_tensors_hooks, or None


_state = _HookState()
# Hook contexts active in any thread; the hot path of every recorded op reads only this.
_active = 0
_active_lock = threading.Lock()


def _count(delta):
    global _active
    with _active_lock:
        _active += delta


def current():
    """The innermost (pack, unpack) pair of this thread, or None (cheap when no hook is active)."""
    if not _active:
        return None
    stack = _state.stack
    return stack[-1] if stack else None


class PackedSaved:
    """A saved tensor in packed form, with the unpack hook that was active when it was packed.

    It also remembers where the original sat in the graph (its grad_fn and output number, or its
    leaf's AccumulateGrad), held weakly, and gives the unpacked tensor that place: a hook that
    copies (to another device, to disk) must not cut a ``create_graph`` backward, as in PyTorch.
    """

    __slots__ = ("packed", "unpack", "_node", "_output_nr", "_leaf")

    def __init__(self, packed, unpack, original):
        self.packed, self.unpack = packed, unpack
        self._node = None
        if original.requires_grad:
            node, self._output_nr = original._gradient_edge()
            self._node = weakref.ref(node)
            self._leaf = original.grad_fn is None

    def place_in_graph(self, value):
        node = self._node() if self._node is not None else None
        if node is None:
            return value
        if self._leaf:
            accumulator = value._grad_accumulator
            if accumulator is not None and accumulator() is node:
                return value  # the leaf itself came back
            tensor = type(value)._make(value.array, True, None, 0)
            tensor._grad_accumulator = self._node  # gradients reach the original leaf
            return tensor
        if value.grad_fn is node and value.output_nr == self._output_nr:
            return value
        return type(value)._make(value.array, True, node, self._output_nr)


class saved_tensors_hooks:
    """Context manager: ``pack_hook`` / ``unpack_hook`` for the tensors saved inside it.

    ``pack_hook(tensor)`` may return any object; ``unpack_hook(obj)`` must return a Tensor with the
    saved tensor's value. Saving a tensor must not modify it, and neither hook may be used to
    change the graph: the unpacked tensor's value is what backward uses.
    """

    def __init__(self, pack_hook, unpack_hook):
        if not callable(pack_hook) or not callable(unpack_hook):
            raise TypeError("saved_tensors_hooks expects two callables (pack_hook, unpack_hook), "
                            f"got {type(pack_hook).__name__} and {type(unpack_hook).__name__}")
        self.pack_hook, self.unpack_hook = pack_hook, unpack_hook

    def __enter__(self):
        if _state.disabled is not None:
            raise RuntimeError(_state.disabled)
        _state.stack = _state.stack + ((self.pack_hook, self.unpack_hook),)
        _count(1)
        return self

    def __exit__(self, *exc):
        if not _state.stack:
            raise RuntimeError("saved_tensors_hooks: exit without a matching enter (no hooks "
                               "are active on this thread)")
        _state.stack = _state.stack[:-1]
        _count(-1)
        return False


def snapshot():
    """This thread's hook state, for ``restore`` (the engine keeps backward from leaking hooks)."""
    return _state.stack, _state.disabled


def restore(saved):
    """Put back a ``snapshot``: hooks a backward entered and never left are dropped."""
    stack, disabled = saved
    leaked = len(_state.stack) - len(stack)
    if leaked:
        _count(-leaked)
    _state.stack, _state.disabled = stack, disabled


class disable_saved_tensors_hooks:
    """Inside it, entering a ``saved_tensors_hooks`` context raises RuntimeError(``error_message``)."""

    def __init__(self, error_message):
        self.error_message = str(error_message)

    def __enter__(self):
        if _state.stack:
            raise RuntimeError(self.error_message)  # hooks are active: they cannot be disabled
        self._prev = _state.disabled
        _state.disabled = self.error_message
        return self

    def __exit__(self, *exc):
        _state.disabled = self._prev
        return False
