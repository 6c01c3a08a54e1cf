"""Version counters: how many times an array's memory was modified in place (``Tensor._version``).

Note [Version counters on memory]
PyTorch keeps one counter per storage, shared by a tensor and its views; saving a tensor for
backward records its version, and unpacking it checks that nothing changed it since. Here a
tensor's memory is a numpy/cupy array, and every view of it (``x[1:]``, ``x.reshape``,
``x.detach()``) is an array whose ``base`` is the array that owns the memory, so the counter is
kept per owning array, in a dict from its id, created by the first in-place op on it. Nothing
is stored on a Tensor: ``Tensor._make`` and the ops that never write in place pay nothing, and
views share their base's counter without being told (``x.data`` is a view whose chain of
``base`` does not lead back, so writes through it are not counted, as in PyTorch: Note
[Tensor.data] in hpcgrad/tensor/_tensor.py).
An array that was never written in place is at version 0, so saving a tensor records nothing
unless some counter exists (``_counters`` empty is the common case).
"""

import weakref

_counters = {}  # id(owning array) -> [version]; an entry leaves with its array


def _owner(array):
    """The array that owns ``array``'s memory (numpy and cupy views point at it by ``base``)."""
    base = array.base
    while base is not None and hasattr(base, "base"):
        array, base = base, base.base
    return array


def version(array):
    """The number of in-place writes into ``array``'s memory so far (0 if never)."""
    if not _counters:
        return 0
    counter = _counters.get(id(_owner(array)))
    return counter[0] if counter is not None else 0


def bump(array):
    """Count one in-place write into ``array``'s memory (a view's write counts for its base)."""
    owner = _owner(array)
    key = id(owner)
    counter = _counters.get(key)
    if counter is None:
        try:
            weakref.finalize(owner, _counters.pop, key, None)
        except TypeError:  # an owner that cannot be watched: count it, and keep it alive
            _keep.append(owner)
        counter = _counters[key] = [0]
    counter[0] += 1


_keep = []
