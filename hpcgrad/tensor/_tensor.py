"""Tensor: an array (numpy or cupy) with requires_grad, grad, grad_fn and backward()."""

import threading
import weakref

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base import devices as _device
from hpcgrad.autograd import executor as _executor
from hpcgrad.autograd import function as _function
from hpcgrad.autograd import grad_mode as _grad_mode
from hpcgrad.autograd import version_counter as _version_counter
from hpcgrad.autograd.graph import AccumulateGrad, _add_hook, make_edge

_accumulator_lock = threading.Lock()
DEFAULT_FLOAT = np.float32


def _as_array(data, dtype=None):
    if isinstance(data, Tensor):
        data = data.array
    if backend.is_gpu_array(data):
        return data if dtype is None else data.astype(dtype, copy=False)
    if dtype is None and not isinstance(data, (np.ndarray, np.generic)):
        array = np.asarray(data)
        if array.dtype == np.float64:  # Python floats give float32, as in PyTorch
            array = array.astype(DEFAULT_FLOAT)
        return array
    return np.asarray(data, dtype=dtype)


class Tensor:
    """A numpy/cupy array that can record the operations applied to it for backward."""

    # data, requires_grad, grad and grad_fn are properties over these slots (Note [Ops without
    # a graph]): no __setattr__/__delattr__ here, so attribute stores stay C member stores.
    __slots__ = ("_data", "_requires_grad", "_grad", "_grad_fn", "_output_nr", "_grad_accumulator",
                 "_hooks", "_post_acc_hooks", "_retains_grad", "__weakref__",
                 "_view", "_views")  # left unset unless a view (Note [Views and in-place ops])
    __array_ufunc__ = None  # ndarray <op> Tensor defers to the Tensor's reflected operator
    __hash__ = object.__hash__
    is_sparse = False  # see hpcgrad.sparse for the row-sparse gradient type
    _wrapped_number = False  # see _WrappedNumber

    def __init__(self, data, requires_grad=False, dtype=None):
        self._data = _as_array(data, dtype)
        self._grad = self._grad_fn = self._grad_accumulator = self._hooks = None
        self._post_acc_hooks = None
        self._output_nr = 0
        self._retains_grad = False
        self._requires_grad = False
        if requires_grad:
            self.requires_grad_(True)

    @classmethod
    def _make(cls, data, requires_grad, grad_fn, output_nr):
        """Fast constructor for op results: no checks, no conversion beyond scalars."""
        t = object.__new__(cls)
        if type(data) is not np.ndarray and not backend.is_gpu_array(data):
            data = np.asarray(data)  # numpy scalars from reductions become 0-d arrays
        t._data = data
        t._requires_grad = requires_grad
        t._grad_fn = grad_fn
        t._output_nr = output_nr
        t._grad = t._grad_accumulator = t._hooks = t._post_acc_hooks = None
        t._retains_grad = False
        return t

    @staticmethod
    def _zeros(shape, dtype, device):
        xp = np if device == backend.CPU else backend.cupy_module()
        return Tensor._make(xp.zeros(shape, dtype), False, None, 0)

    def __deepcopy__(self, memo):
        """A new leaf with copied data; never shares the original's grad accumulator or hooks."""
        if self.grad_fn is not None:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support "
                               "the deepcopy protocol; use .detach().clone() for results of ops")
        copy = type(self)._make(self.array.copy(), False, None, 0)
        copy.requires_grad = self.requires_grad
        memo[id(self)] = copy
        if self.grad is not None:
            copy.grad = self.grad.detach_copy()
        return copy

    def __reduce_ex__(self, protocol):
        """Pickle as data + requires_grad (a graph and its hooks do not travel)."""
        if self.grad_fn is not None:
            raise RuntimeError("cannot pickle a Tensor that is the result of an op (it has a "
                               "grad_fn); pickle .detach() instead")
        return (_rebuild_tensor, (type(self), backend.to_device(self.array, backend.CPU),
                                  self.requires_grad))

    # --- array facts ----------------------------------------------------------------------
    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)
    device = property(lambda self: backend.device_of(self.array))
    is_leaf = property(lambda self: self.grad_fn is None)
    retains_grad = property(lambda self: self._retains_grad)
    output_nr = property(lambda self: self._output_nr)

    def dim(self):
        return self.array.ndim

    def size(self, dim=None):
        return self.array.shape if dim is None else self.array.shape[dim]

    def numel(self):
        return int(self.array.size)

    def __len__(self):
        return len(self.array)

    def item(self):
        return self.array.item()

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(t)``: ``numpy()``'s array (a copy for a GPU tensor), as PyTorch's."""
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def numpy(self):
        if self.requires_grad and _grad_mode._state.enabled:  # allowed under no_grad, as PyTorch
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                               "Use tensor.detach().numpy() instead.")
        return backend.to_device(self.array, backend.CPU)

    def tolist(self):
        return self.array.tolist()

    def __bool__(self):
        return bool(self.array)

    def __float__(self):
        return float(self.array)

    def __int__(self):
        return int(self.array)

    def __repr__(self):
        extra = ""
        if self.grad_fn is not None:
            extra = f", grad_fn=<{self.grad_fn.name()}>"
        elif self.requires_grad:
            extra = ", requires_grad=True"
        device = "" if self.device == backend.CPU else f", device='{self.device}'"
        body = np.array2string(backend.to_device(self.array, backend.CPU), separator=", ",
                               prefix="tensor(")
        return f"tensor({body}, dtype={self.array.dtype}{device}{extra})"

    # --- autograd -------------------------------------------------------------------------
    def requires_grad_(self, requires_grad=True):
        if self.grad_fn is not None and not requires_grad:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you "
                               "want to use a computed variable in a subgraph that doesn't require "
                               "differentiation use var_no_grad = var.detach().")
        if requires_grad and self.array.dtype.kind not in "fc":
            raise RuntimeError(f"only Tensors of floating point dtype can require gradients "
                               f"(got {self.array.dtype}); convert first, e.g. x.float()")
        self.requires_grad = bool(requires_grad)
        return self

    def detach(self):
        """Same data, cut from the graph."""
        return Tensor._make(self.array, False, None, 0)

    def detach_(self):
        """Cut this tensor from the graph in place: a leaf that does not require grad (its
        ``retains_grad`` and hooks stay, as PyTorch's). Refused for a view, as PyTorch."""
        if getattr(self, "_view", None) is not None:
            raise RuntimeError(
                "Can't detach views in-place. Use detach() instead. If you are using "
                "DistributedDataParallel (DDP) for training, and gradient_as_bucket_view is set "
                "as True, gradients are views of DDP buckets, and hence detach_() cannot be "
                "called on these gradients. To fix this error, please refer to the "
                "Optimizer.zero_grad() function in torch/optim/optimizer.py as the solution.")
        self._requires_grad, self._grad_fn, self._output_nr = False, None, 0
        return self

    def detach_copy(self):
        return Tensor._make(self.array.copy(), False, None, 0)

    def _gradient_edge(self):
        fn = self._grad_fn
        if fn is not None:
            if type(fn) in _views.multi_view_nodes:  # Note [Outputs of multi-view ops]
                _views.check_multi_view(self)
            return make_edge(fn, self._output_nr)
        return make_edge(self._get_accumulator(), 0)

    def _get_accumulator(self):
        """The leaf's AccumulateGrad; held weakly, so it lives as long as a graph uses it."""
        acc = self._grad_accumulator() if self._grad_accumulator is not None else None
        if acc is None:
            if not self.requires_grad:
                raise RuntimeError("a tensor that does not require grad has no grad accumulator")
            with _accumulator_lock:
                acc = self._grad_accumulator() if self._grad_accumulator is not None else None
                if acc is None:
                    acc = AccumulateGrad(self)
                    acc._tensor_pre_hooks = self._hooks  # leaf hooks outlive any one accumulator
                    self._grad_accumulator = weakref.ref(acc)
        return acc

    def register_hook(self, hook):
        """``hook(grad) -> new grad or None``, called when this tensor's gradient is computed."""
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self.grad_fn is not None:
            return self.grad_fn.register_tensor_prehook(self._output_nr, hook)
        if self._hooks is None:
            self._hooks = {}
            acc = self._grad_accumulator() if self._grad_accumulator is not None else None
            if acc is not None:
                acc._tensor_pre_hooks = self._hooks
        return _add_hook(self._hooks, hook, 0)

    def register_post_accumulate_grad_hook(self, hook):
        """``hook(tensor)`` runs after backward has accumulated this leaf's ``.grad`` (returns None).

        For optimizer steps fused into backward; registered on leaves only, as in PyTorch.
        """
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self.grad_fn is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if self._post_acc_hooks is None:
            self._post_acc_hooks = {}
        return _add_hook(self._post_acc_hooks, hook)

    def retain_grad(self):
        """Keep this non-leaf tensor's gradient in ``.grad`` after backward."""
        if not self.requires_grad:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if self.grad_fn is None or self._retains_grad:
            return
        ref = weakref.ref(self)

        def retain(grad):
            tensor = ref()
            if tensor is None or grad is None:
                return
            if tensor.grad is None:
                tensor.grad = grad.detach_copy() if grad.grad_fn is None else grad
            else:
                tensor.grad = tensor.grad + grad

        self.grad_fn.set_retains_grad_hook(self._output_nr, retain)
        self._retains_grad = True

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` (see autograd.backward)."""
        from hpcgrad.autograd import backward
        backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    # --- conversion -----------------------------------------------------------------------
    def to(self, *args, **kwargs):
        """PyTorch's forms, differentiably: ``to(np.float64)`` casts, ``to("cuda:0")``,
        ``to(hpcgrad.device("cpu"))`` or ``to(0)`` moves, ``to(device, dtype)``,
        ``to(device=, dtype=)``, ``to(other)`` takes other's device and dtype; itself when
        nothing changes."""
        if len(args) == 1 and not kwargs and type(args[0]) is not str:  # the common cast
            try:
                dtype = np.dtype(args[0])
            except TypeError:
                dtype = None
            if dtype is not None and not isinstance(args[0], (int, np.integer)):
                return self if dtype == self.array.dtype else _ops.Cast.apply(self, dtype)
        device, dtype = _device.parse_to(args, kwargs, "to")
        out = self
        if device is not None and device != out.device:
            out = _ops.ToDevice.apply(out, device)
        if dtype is not None and dtype != out.array.dtype:
            out = _ops.Cast.apply(out, dtype)
        return out

    def float(self):
        return self.to(np.float32)

    def double(self):
        return self.to(np.float64)

    def half(self):
        return self.to(np.float16)

    def long(self):
        return self.to(np.int64)

    def cpu(self):
        return self.to("cpu")

    def cuda(self, device=0):
        return self.to(f"cuda:{device}")

    def clone(self):
        """A copy that keeps this tensor's memory layout (PyTorch's preserve_format)."""
        return _ops.Clone.apply(self, "K")

    def contiguous(self):
        """Itself when its memory is in C order (as PyTorch), else a C-ordered copy (a Clone)."""
        return self if self.array.flags.c_contiguous else _ops.Clone.apply(self)

    def is_contiguous(self):
        return bool(self.array.flags.c_contiguous)  # size-1 axes' strides ignored, as PyTorch

    # --- arithmetic -----------------------------------------------------------------------
    def _other(self, other):
        if isinstance(other, Tensor):
            return other
        if isinstance(other, (int, float, bool)):  # a Python number: the lowest promotion rank
            array = self.array
            value = array.dtype.type(other) if array.dtype.kind in "fc" else _as_array(other)
            if type(array) is not np.ndarray and backend.is_gpu_array(array):
                # cupy takes a numpy scalar as a kernel argument (as PyTorch passes a wrapped
                # number to a CUDA kernel) but refuses a numpy array, even a 0-d one.
                return _WrappedNumber._scalar(value[()])
            return _WrappedNumber._make(value, False, None, 0)
        return Tensor._make(_as_array(other), False, None, 0)

    def __add__(self, other):
        if type(other) is not Tensor and getattr(other, "is_sparse", False):
            return other + self  # a dense gradient meets a sparse one in an InputBuffer
        return _add(self, other if type(other) is Tensor else self._other(other))

    def __radd__(self, other):
        return _add(self._other(other), self)

    def __sub__(self, other):
        return _sub(self, other if type(other) is Tensor else self._other(other))

    def __rsub__(self, other):
        return _sub(self._other(other), self)

    def __mul__(self, other):
        return _mul(self, other if type(other) is Tensor else self._other(other))

    def __rmul__(self, other):
        return _mul(self._other(other), self)

    def __truediv__(self, other):
        return _div(self, other if type(other) is Tensor else self._other(other))

    def __rtruediv__(self, other):
        return _div(self._other(other), self)

    def __pow__(self, exponent):
        return _ops.Pow.apply(self, self._other(exponent))

    def __rpow__(self, base):
        return _ops.Pow.apply(self._other(base), self)

    def __neg__(self):
        return _neg(self)

    def __matmul__(self, other):
        return _ops.MatMul.apply(self, self._other(other))

    def __rmatmul__(self, other):
        return _ops.MatMul.apply(self._other(other), self)

    def __getitem__(self, index):
        return _ops.getitem(self, index)

    # Comparisons give boolean tensors outside the graph.
    def _compare(self, other, op):
        """Compared in the dtype PyTorch's promotion gives (float32 0.1 == a float64 0.1)."""
        other = other if isinstance(other, Tensor) else self._other(other)
        x, y = self.array, other.array
        if x.dtype != y.dtype:
            dtype = _promotion.binary_result_type(self, other)
            x, y = x.astype(dtype, copy=False), y.astype(dtype, copy=False)
        return Tensor._make(op(x, y), False, None, 0)

    def __eq__(self, other):
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other):
        return self._compare(other, lambda a, b: a != b)

    def __lt__(self, other):
        return self._compare(other, lambda a, b: a < b)

    def __le__(self, other):
        return self._compare(other, lambda a, b: a <= b)

    def __gt__(self, other):
        return self._compare(other, lambda a, b: a > b)

    def __ge__(self, other):
        return self._compare(other, lambda a, b: a >= b)

    # PyTorch's method names of the comparisons (``pred.eq(target.view_as(pred))``)
    eq, ne, lt, le, gt, ge = __eq__, __ne__, __lt__, __le__, __gt__, __ge__
    greater, greater_equal, less, less_equal, not_equal = gt, ge, lt, le, ne

    def equal(self, other):
        """True if ``other`` has this shape and the same elements (PyTorch's torch.equal)."""
        return self.shape == other.shape and bool((self == other).array.all())

    # --- element-wise, reductions, shapes: see hpcgrad/ops -----------------------------------
    def exp(self):
        return _ops.Exp.apply(self)

    def log(self):
        return _ops.Log.apply(self)

    def sqrt(self):
        return _ops.Sqrt.apply(self)

    def abs(self):
        return _ops.Abs.apply(self)

    def tanh(self):
        return _ops.Tanh.apply(self)

    def sigmoid(self):
        return _ops.Sigmoid.apply(self)

    def relu(self):
        return _ops.Relu.apply(self)

    def clamp(self, min=None, max=None):
        if isinstance(min, Tensor) or isinstance(max, Tensor):
            # Tensor bounds, as PyTorch's: min(max(self, min), max), broadcast; where self
            # equals a bound the gradient is shared (maximum/minimum's rule), PyTorch's goes
            # to self.
            maximum, minimum = _ops.elementwise.maximum, _ops.elementwise.minimum
            out = self if min is None else maximum(self, min if isinstance(min, Tensor)
                                                   else self._scalar_like(min))
            return out if max is None else minimum(out, max if isinstance(max, Tensor)
                                                   else self._scalar_like(max))
        return _ops.Clamp.apply(self, min, max)

    def _scalar_like(self, number):
        return Tensor._make(np.asarray(number, self.array.dtype), False, None, 0)

    def sum(self, dim=None, keepdim=False):
        return _ops.Sum.apply(self, _ops.normalize_dims(dim, self.array.ndim), keepdim)

    def mean(self, dim=None, keepdim=False):
        return _ops.mean(self, dim, keepdim)

    def var(self, dim=None, keepdim=False, correction=1, unbiased=None):
        return _ops.var(self, dim, keepdim, correction if unbiased is None else int(unbiased))

    def amax(self, dim=None, keepdim=False):
        return _ops.Amax.apply(self, _ops.normalize_dims(dim, self.array.ndim), keepdim)

    def max(self, dim=None, keepdim=False):
        return _ops.max(self, dim, keepdim)

    def argmax(self, dim=None, keepdim=False):
        return _ops.reduce.argmax(self, dim, keepdim)

    def sum_to_size(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return self if shape == self.array.shape else _ops.SumToSize.apply(self, shape)

    def reshape(self, *shape):
        return _ops.shape.reshape(self, _ops.shape_arg(shape, self.array.size))

    def view(self, *shape):
        """The same data in ``shape`` without a copy; raises where only ``reshape`` can."""
        return _ops.shape.view(self, _ops.shape_arg(shape, self.array.size))

    def flatten(self, start_dim=0, end_dim=-1):
        return _ops.flatten(self, start_dim, end_dim)

    def unsqueeze(self, dim):
        return _ops.unsqueeze(self, dim)

    def squeeze(self, dim=None):
        return _ops.squeeze(self, dim)

    def permute(self, *dims):
        dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
        return _ops.shape.permute(self, tuple(_ops.wrap_dim(d, self.array.ndim) for d in dims))

    def transpose(self, dim0, dim1):
        return _ops.transpose(self, dim0, dim1)

    T = property(lambda self: _ops.shape.permute(self, tuple(reversed(range(self.array.ndim)))))
    mT = property(lambda self: _ops.transpose(self, -2, -1))

    def expand(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return _ops.expand(self, shape)

    def flip(self, *dims):
        dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
        return _ops.shape.flip(self, dims)

    def expand_as(self, other):
        return _ops.expand(self, other.shape)

    def view_as(self, other):
        return self.view(other.shape)

    def reshape_as(self, other):
        return self.reshape(other.shape)

    def type_as(self, other):
        """Cast (differentiably) to ``other``'s dtype, moved to its device."""
        return self.to(other)

    def gather(self, dim, index):
        return _ops.gather(self, dim, index)

    def index_select(self, dim, index):
        return _ops.index_select(self, dim, index)

    def softmax(self, dim=-1):
        return _ops.Softmax.apply(self, dim)

    def log_softmax(self, dim=-1):
        return _ops.LogSoftmax.apply(self, dim)

    # --- issue 17's ops: ops/elementwise.py, ops/reduce.py, ops/split.py, ops/indexing.py ----
    def sin(self):
        return _ops.elementwise.Sin.apply(self)

    def cos(self):
        return _ops.elementwise.Cos.apply(self)

    def maximum(self, other):
        return _ops.elementwise.maximum(self, other)

    def minimum(self, other):
        return _ops.elementwise.minimum(self, other)

    def min(self, dim=None, keepdim=False):
        return _ops.reduce.min(self, dim, keepdim)

    def argmin(self, dim=None, keepdim=False):
        return _ops.reduce.argmin(self, dim, keepdim)

    def cumsum(self, dim, dtype=None):
        return _ops.reduce.cumsum(self, dim, dtype)

    def split(self, split_size, dim=0):
        return _split.split(self, split_size, dim)

    def chunk(self, chunks, dim=0):
        return _split.chunk(self, chunks, dim)

    def unbind(self, dim=0):
        return _split.unbind(self, dim)

    def masked_fill(self, mask, value):
        return _indexing.masked_fill(self, mask, value)

    def scatter_add(self, dim, index, src):
        return _indexing.scatter_add(self, dim, index, src)

    def topk(self, k, dim=-1, largest=True, sorted=True):
        return _indexing.topk(self, k, dim, largest, sorted)
    # --- end of issue 17's ops ---------------------------------------------------------------

    # --- in-place ops, versions and views: ops/inplace.py, ops/views.py -----------------------
    @property
    def _version(self):
        """Writes into this tensor's memory so far (shared with its views; see version_counter)."""
        return _version_counter.version(self._data)

    @property
    def _base(self):
        """The tensor this one is a view of (recorded for views made with grad mode on)."""
        info = getattr(self, "_view", None)
        return None if info is None else info.base

    def _is_view(self):
        return getattr(self, "_view", None) is not None

    def t(self):
        if self.array.ndim > 2:
            raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is "
                               f"{self.array.ndim}D")
        if self.array.ndim == 2:
            return _ops.transpose(self, 0, -1)
        return _ops.shape.permute(self, tuple(range(self.array.ndim)))  # a new view, as PyTorch

    def narrow(self, dim, start, length):
        return _ops.shape.narrow(self, dim, start, length)

    def select(self, dim, index):
        return _ops.shape.select(self, dim, index)

    def __setitem__(self, index, value):
        _inplace.setitem(self, index, value)

    def __iadd__(self, other):
        return _inplace.add_(self, other)

    def __isub__(self, other):
        return _inplace.sub_(self, other)

    def __imul__(self, other):
        return _inplace.mul_(self, other)

    def __itruediv__(self, other):
        return _inplace.div_(self, other)

    def __ipow__(self, other):
        return _inplace.pow_(self, other)
    # (add_, mul_, relu_, zero_, copy_ ...: set from ops/inplace.py at the end of this file)
    # --- end of in-place ops ------------------------------------------------------------------


def _slot_property(name, doc, deleter=None):
    """A public attribute over slot ``_<name>``: get and set are the slot's own C methods.

    Note [Ops without a graph]: a Python ``__setattr__`` or ``__delattr__`` on Tensor made every
    attribute store (nine per new Tensor) a call through ``slot_tp_setattro``, about 930
    instructions each; properties put the deletion rules where only deletion pays for them.
    """
    slot = Tensor.__dict__["_" + name]

    def refuse(self):
        raise RuntimeError(f"The {name} attribute of a Tensor cannot be deleted")

    return property(slot.__get__, slot.__set__, deleter or refuse, doc)


Tensor.array = _slot_property("data", "The array (numpy or cupy) that holds the values.")


def _get_data(self):
    """PyTorch's ``x.data``: a Tensor over ``x``'s memory, outside the graph (Note [Tensor.data])."""
    return Tensor._make(_untracked_view(self._data), False, None, 0)


def _set_data(self, value):
    if isinstance(value, Tensor):
        value = value._data
        source = value.base.obj if type(value.base) is memoryview else None
        if (source is self._data and source.shape == value.shape and source.dtype == value.dtype
                and source.strides == value.strides):
            return  # ``p.data -= u``: the memory already is p's; keep p's own array
    elif not (isinstance(value, np.ndarray) or backend.is_gpu_array(value)):
        raise TypeError(f"Variable data has to be a tensor, but got {type(value).__name__}: "
                        f"assign a Tensor (or a numpy/cupy array) to .data")
    self._data = value


def _untracked_view(array):
    """A view of ``array``'s memory that owns its own version counter.

    Note [Tensor.data]
    PyTorch's ``x.data`` shares ``x``'s storage but not its version counter: writes through it
    (``p.data.add_(g, alpha=-lr)``, ``p.data.copy_(w)``) are invisible to autograd's checks of
    saved tensors. Counters here are kept per owning array, found by following ``.base``
    (Note [Version counters on memory]), so the view must not lead back to ``array``: numpy's
    is made through a memoryview (which has no ``base``), cupy's over the same device pointer.
    Every read of ``.data`` builds one such view (about a microsecond); the package itself
    reads ``Tensor.array``, the array itself.
    """
    if isinstance(array, np.ndarray):
        try:
            return np.asarray(memoryview(array))
        except (TypeError, ValueError, BufferError):  # a dtype the buffer protocol lacks
            return array.view()
    cupy = backend.cupy_module()
    return cupy.ndarray(array.shape, array.dtype, memptr=array.data, strides=array.strides)


def _refuse_delete(self):
    raise RuntimeError("The data attribute of a Tensor cannot be deleted")


Tensor.data = property(_get_data, _set_data, _refuse_delete,
                       "A Tensor sharing this one's memory, outside the graph and its version "
                       "checks, as PyTorch's (the array itself: ``Tensor.array``).")
Tensor.requires_grad = _slot_property("requires_grad", "Whether ops on it record a graph.")
Tensor.grad_fn = _slot_property("grad_fn", "The Node that made it (None for a leaf).")
# ``del t.grad`` clears the gradient, as PyTorch; the other attributes cannot go.
Tensor.grad = _slot_property("grad", "The accumulated gradient (a Tensor) or None.",
                             lambda self: Tensor._grad.__set__(self, None))


class _WrappedNumber(Tensor):
    """A Python number given to an op (``x * 3``): saved like a tensor, but saved-tensor hooks
    never see it, as PyTorch's wrapped numbers."""

    __slots__ = ()
    _wrapped_number = True

    @classmethod
    def _scalar(cls, value):
        """A number for a GPU tensor's op, kept a numpy scalar (``_make`` makes a 0-d array)."""
        number = cls._make(value, False, None, 0)
        number._data = value
        return number


def _rebuild_tensor(cls, data, requires_grad):
    t = cls._make(data, False, None, 0)
    t.requires_grad = requires_grad
    return t


_function.Tensor = _executor.Tensor = Tensor

from hpcgrad.tensor import ops as _ops  # noqa: E402  (the ops build on Tensor)
from hpcgrad.tensor.ops import indexing as _indexing  # issue 17's ops, below ops in the same layer
from hpcgrad.tensor.ops import inplace as _inplace  # in-place ops, below ops in the same layer
from hpcgrad.tensor.ops import promotion as _promotion
from hpcgrad.tensor.ops import split as _split
from hpcgrad.tensor.ops import views as _views

for _name in ("add_", "sub_", "mul_", "div_", "pow_", "clamp_", "clamp_min_", "clamp_max_",
              "neg_", "exp_", "log_", "sqrt_", "abs_", "tanh_", "sigmoid_", "relu_", "sin_",
              "cos_", "zero_", "fill_", "copy_", "masked_fill_", "t_", "transpose_",
              "scatter_", "scatter", "random_", "uniform_", "normal_"):
    setattr(Tensor, _name, getattr(_inplace, _name))
del _name

# The operators' Functions, bound once: ``_ops.Mul.apply`` looked up per call cost a module and
# a class attribute lookup and a new bound method; and an apply for exactly their Tensor
# arguments, without Function.apply's ``*args`` (Note [Ops without a graph]).
_add, _sub, _mul, _div = (_function._tensor_apply(op, 2) for op in (_ops.Add, _ops.Sub,
                                                                    _ops.Mul, _ops.Div))
_neg = _function._tensor_apply(_ops.Neg, 1)
