"""DistributedDataParallel: one model replica per rank, gradients averaged by the Reducer."""

import contextlib
import copy
import dataclasses
import inspect
import math
import numbers
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from hpcgrad.base import backend
from hpcgrad import collectives as dist
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.comm import progress
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.comm.process_group import ProcessGroup
from hpcgrad.comm.work import CommTimeoutError, wait_requests
from hpcgrad.collectives import api as dist_api
from hpcgrad.collectives.join import (Join, JoinHook, Joinable, _JoinConfig,
                                      raise_if_a_rank_exhausted)
from hpcgrad.collectives.grad_bucket import GradBucket
from hpcgrad.base.futures import Future
from hpcgrad.nn.module import Module
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.ddp import buckets as bucket_rules
from hpcgrad.ddp.reducer import Reducer


def _children(item):
    """The items directly inside a container of a forward's output (torch's _find_tensors)."""
    if isinstance(item, (list, tuple, set, frozenset)):  # namedtuples are tuples
        return list(item)
    if isinstance(item, dict):
        return list(item.values())
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return [getattr(item, f.name) for f in dataclasses.fields(item)]
    return []


def _find_tensors(obj):
    """Every Tensor in a forward's output (tensors in lists, tuples, namedtuples, dicts, sets
    and dataclasses), without recursion."""
    found, stack = [], [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            found.append(item)
        else:
            stack.extend(_children(item))
    return found


def _replace_tensors(obj, new):
    """``obj`` rebuilt with each Tensor ``t`` replaced by ``new[id(t)]`` where given.

    Recursive: an output's nesting is a few containers deep, not a graph. Namedtuples and
    dataclasses keep their type (a dataclass is copied, its fields reassigned, frozen or not).
    """
    if isinstance(obj, Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_replace_tensors(x, new) for x in obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return type(obj)(_replace_tensors(x, new) for x in obj)
    if isinstance(obj, dict):
        rebuilt = copy.copy(obj)  # keeps OrderedDict/defaultdict and their extras
        for key, value in obj.items():
            rebuilt[key] = _replace_tensors(value, new)
        return rebuilt
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        rebuilt = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(rebuilt, f.name, _replace_tensors(getattr(obj, f.name), new))
        return rebuilt
    return obj


class _DDPSink(Function):
    """Identity on the forward's outputs that tells the reducer which of them reach the loss.

    As PyTorch's _DDPSink: backward sees every output's gradient at once, None for an output
    left out of the loss, so parameters reachable only from such outputs are marked unused
    (find_unused_parameters) instead of leaving their buckets unreduced.
    """

    @staticmethod
    def forward(ctx, reducer_ref, *tensors):
        ctx.set_materialize_grads(False)
        ctx.reducer_ref = reducer_ref
        ctx.roots = [t.grad_fn for t in tensors]
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer_ref()
        if reducer is not None:
            reducer.queue_end_of_backward()  # static_graph only (Note [Static graph])
            reducer.outputs_left_out([fn for fn, g in zip(ctx.roots, grads)
                                      if g is not None and fn is not None])
        return (None,) + grads


def _check_comm_hook(hook):
    """PyTorch's checks of a comm hook, at registration: callable, ``(state, bucket)``, and
    annotations (when given) of a GradBucket parameter and a Future result."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: judged when it runs
    try:
        sig.bind(None, None)
    except TypeError as error:
        raise TypeError(f"Communication hook must take two arguments (state, bucket); "
                        f"{getattr(hook, '__qualname__', hook)}{sig} cannot: {error}") from None
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty \
            and not _names(bucket.annotation, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if sig.return_annotation is not inspect.Signature.empty \
            and not _names(sig.return_annotation, Future):
        raise ValueError("Communication hook: return annotation should be "
                         "hpcgrad.distributed.Future (torch.futures.Future[torch.Tensor]).")


def _names(annotation, cls):
    """``annotation`` is ``cls``, a generic of it, or a string naming it (``from __future__
    import annotations``)."""
    if isinstance(annotation, str):
        return annotation.split("[")[0].split(".")[-1] == cls.__name__
    return annotation is cls or getattr(annotation, "__origin__", None) is cls


# Note [DDP's own communicator]
# MPI matches collectives on a communicator by the order ranks post them, whatever they are:
# on the user's communicator, DDP's nonblocking bucket all-reduce on one rank would match a
# user's all_reduce of the same size on another (a rank a step ahead, a metric reduced before
# backward) and each would silently add into the other. So DDP runs every collective of its
# own (construction check and broadcasts, buffer syncs, bucket reductions, bucket rebuilds,
# join's counts) on a duplicate of the group's communicator, as the RPC agent has one: made
# at construction, which every rank calls at the same point (MPI_Comm_idup, bounded by the
# group's timeout), freed when the DDP is collected. An unpickled DDP makes its duplicate at
# its first collective, so unpickling stays local. Comm hooks still run on whatever group
# their state names: the user's.
#
# Note [DDP in the flight recorder]
# The duplicate is recorded under a name of its own, "DDP(default)" or "DDP(new_group([0,
# 1]))" (the user's group's recorder name inside), so a stall or divergence in DDP's calls
# reads as DDP's, numbered apart from the user's collectives on the group. Recorder ids are
# registration order and must agree on every rank that registers groups (Note [Flight
# recorder]): new_group registers on every rank of the default group, members or not. A DDP
# over a group of every rank of the default group is built by all of them at the same point
# of their programs, so each registers it there and the ids still agree. A DDP over a
# smaller group is built by its members only: registered there, it would shift every later
# group's id on the members and not elsewhere, and rank 0's stall inspector would not know
# it; so its calls stay under the user's group's id (and name), as before.
def _recorder_name(group):
    """The user's group's name in the flight recorder ("default", "new_group([0, 1])")."""
    groups = RECORDER.groups()
    return groups[group._gid][0] if 0 <= group._gid < len(groups) else str(group._gid)


def _spans_default_group(group):
    try:
        default = dist_api._group(None)
    except RuntimeError:
        return False
    return group is default or group.size() == default.size()


# Note [DDP construction meets first]
# MPI_Comm_idup is nonblocking, but the flight recorder does not see it: a DDP built on some
# ranks only waited there in silence until the group's timeout (30 minutes by default). So
# the ranks first meet in a barrier through the group's own API: recorded like any call of
# the group, so the stall inspector reports it at HPCGRAD_STALL_WARNING (which ranks are in
# it, what the others do), and bounded by the group's timeout, past which every rank that
# came raises naming DDP's construction and the ranks that may not have come. Once every
# rank is in the barrier, the duplicate completes at once. It is a call on the user's group,
# at a point every rank reaches together anyway (the duplicate is collective over it).
def _meet(group):
    """Return once every rank of ``group`` is constructing DDP (Note [DDP construction meets
    first]); CommTimeoutError past the group's timeout."""
    try:
        group.ibarrier().wait()
    except CommTimeoutError as error:
        me = group.ranks[group.rank()]
        others = [r for r in group.ranks if r != me]
        who = (f"rank {others[0]} did not come" if len(others) == 1 else
               f"one or more of ranks {', '.join(map(str, others))} did not come (the stall "
               f"inspector's report, at HPCGRAD_STALL_WARNING, names them)")
        raise CommTimeoutError(
            f"DistributedDataParallel construction on group {_recorder_name(group)} (world "
            f"ranks {', '.join(map(str, group.ranks))}) did not complete within "
            f"{group.timeout:g} s on rank {me}: {who}. Every rank of the group must construct "
            f"DDP at the same point of its program (or run its first synced forward after "
            f"unpickling together); the group is unusable now ({error})") from None


def private_group(group):
    """A ProcessGroup over a duplicate of ``group``'s communicator (same ranks, same timeout);
    collective over ``group``, raising CommTimeoutError past its timeout."""
    _meet(group)
    comm, request = group.comm.Idup()
    wait_requests([request], group.timeout,
                  lambda: f"DistributedDataParallel's communicator duplicate (MPI_Comm_idup) "
                          f"in a group of {group.size()} ranks: every rank must construct "
                          f"DDP (or run its first synced forward after unpickling) together")
    if _spans_default_group(group):  # Note [DDP in the flight recorder]
        return ProcessGroup(comm, group.timeout, group.ranks,
                            name=f"DDP({_recorder_name(group)})")
    return ProcessGroup(comm, group.timeout, group.ranks, recorder_id=group._gid)


def _free_group(group):
    if not MPI.Is_finalized():
        group.free()


def check_bucket_cap_mb(value):
    """``bucket_cap_mb`` as a float: any positive, finite number of megabytes (as PyTorch,
    however small: then every parameter gets a bucket of its own); None means 25."""
    if value is None:
        return 25.0
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
            and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"bucket_cap_mb must be a positive, finite number of megabytes (a "
                     f"float such as 25 or 0.5), got {value!r}; leave it out (or None) for "
                     f"the default 25")


def _describe(entry, kind=True):
    what, name, shape, dtype, requires_grad = entry
    frozen = " (requires_grad=False)" if what == "parameter" and not requires_grad else ""
    return f"{what + ' ' if kind else ''}{name} {shape} {dtype}{frozen}"


def _first_difference(theirs, reference, first):
    """How ``theirs`` (entries of _verify_same_model) first differs from rank ``first``'s
    ``reference``, or None when they are the same."""
    names = {entry[1] for entry in reference}
    their_names = {entry[1] for entry in theirs}
    for i in range(max(len(theirs), len(reference))):
        if i < len(theirs) and i < len(reference) and theirs[i] == reference[i]:
            continue
        if i < len(theirs) and (i >= len(reference) or theirs[i][1] not in names):
            return f"has {_describe(theirs[i])} that rank {first} does not have"
        if i >= len(theirs) or reference[i][1] not in their_names:
            return f"lacks {_describe(reference[i])} of rank {first}"
        same_kind = theirs[i][0] == reference[i][0]
        return (f"has {_describe(theirs[i])} where rank {first} has "
                f"{_describe(reference[i], not same_kind)}")
    return None


class DistributedDataParallel(Module, Joinable):
    """Wraps ``module``: same parameters on every rank, gradients averaged during backward.

    Every rank builds the same model and calls forward/backward in step; gradients are
    reduced in buckets of ``bucket_cap_mb`` while backward still runs. Parameters and buffers
    start from rank 0's values. See docs/distributed.rst, "Data parallel", for the options. A
    group spanning nodes starts the progress thread, so the all-reduces cross the network while backward
    computes (Note [Progress across nodes] in comm/progress.py; ``self.nodes`` counts them).
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, forward_sync_buffers=None):
        super().__init__()
        Joinable.__init__(self)  # join(): Note [Join] in hpcgrad/collectives/join.py
        if static_graph and find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "static_graph=True will detect unused parameters automatically, so you "
                          "do not need to set find_unused_parameters=true, just be sure these "
                          "unused parameters will not change during training loop while using "
                          "static_graph (Note [Static graph]).", stacklevel=2)
        self.module = module
        # PyTorch's _set_params_and_buffers_to_ignore_for_model: neither broadcast nor reduced.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.process_group = process_group or dist.init_process_group()
        self._init_buffer_options(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._join_divide = True  # divide_by_initial_world_size of the current join context
        self._shadow_syncing = False  # a joined rank: whether the iteration it shadows syncs
        self._joined_ever = False  # join() entered once: _get_ddp_logging_data says so
        self._trained = 0  # synced iterations this rank ran itself: its model is current if max
        self._bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        named = self._named_trainable()
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                               "any parameter that requires a gradient.")
        self._own_group = None
        self._private_group()  # collective: every rank constructs DDP at the same point
        self._verify_same_model()
        self._sync_module_states()
        self._build_reducer(named)

    def _named_trainable(self):
        return [(n, p) for n, p in self._named_synced("parameters") if p.requires_grad]

    def _named_synced(self, kind):
        """``module.named_parameters()`` or ``named_buffers()`` less the ignored names."""
        named = getattr(self.module, f"named_{kind}")()
        return [(n, t) for n, t in named if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """Before wrapping ``module`` in DDP: the parameters and buffers it names (fully
        qualified names within ``module``, as ``named_parameters()``/``named_buffers()`` give
        them) are neither broadcast at construction or before forward, nor checked across
        ranks, nor reduced: their values and gradients stay this rank's own. PyTorch's static
        method, which sets ``module._ddp_params_and_buffers_to_ignore``; names that match
        nothing are ignored, as there."""
        if isinstance(params_and_buffers_to_ignore, str):
            raise TypeError(f"params_and_buffers_to_ignore must be a list of names, got the "
                            f"string {params_and_buffers_to_ignore!r}; wrap it in a list")
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    def _build_reducer(self, named):
        """The Reducer over ``named``: local work only (no collective), so unpickling can too."""
        params = [p for _, p in named]
        sparse_weights = {id(m.weight) for m in self.module.modules()
                          if getattr(m, "sparse", False) and hasattr(m, "weight")}
        expect_sparse = [id(p) in sparse_weights for p in params]
        cap = int(self._bucket_cap_mb * (1 << 20))
        # Built in registration order, then reversed: gradients arrive roughly last-to-first.
        indices = bucket_rules.compute_bucket_assignment_by_size(
            params, [bucket_rules.DEFAULT_FIRST_BUCKET_BYTES, cap], expect_sparse)
        # Until this DDP has its own communicator (an unpickled one, before its first
        # collective) the reducer holds the user's group, never used: _private_group swaps it.
        object.__setattr__(self, "reducer", Reducer(
            params, list(reversed(indices)), self._own_group or self.process_group,
            expect_sparse, cap, self.find_unused_parameters, self.gradient_as_bucket_view,
            [n for n, _ in named], self.static_graph))

    def _private_group(self):
        """DDP's own communicator (Note [DDP's own communicator]), duplicated at first need."""
        group = self._own_group
        if group is None:
            group = self._own_group = private_group(self.process_group)
            weakref.finalize(self, _free_group, group).atexit = False
            reducer = self.__dict__.get("reducer")
            if reducer is not None:
                reducer.process_group = group
        return group

    # --- pickling ------------------------------------------------------------------------------
    def _check_default_group(self):
        try:
            default = dist_api._group(None)
        except RuntimeError:
            default = None
        if self.process_group is not default:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with "
                               "the default process group. That is, when you have called "
                               "init_process_group and have not passed process_group argument "
                               "to DDP constructor")

    def __getstate__(self):
        """As PyTorch: the process group and the reducer (MPI handles, hooks) stay behind."""
        self._check_default_group()
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        state["_join_config"] = _JoinConfig.construct_disabled_join_config()
        state["_own_group"] = None  # a communicator is this process's
        return state

    def __setstate__(self, state):
        """The default group of this process, and a new reducer over the copied parameters;
        DDP's own communicator is duplicated (collectively) at the copy's first collective."""
        self.__dict__.update(state)
        object.__setattr__(self, "process_group", dist_api._group(None))
        self._build_reducer(self._named_trainable())

    # --- construction ---------------------------------------------------------------------------
    def _verify_same_model(self):
        """Every rank raises, naming the first rank whose model differs from the first rank's
        and the first parameter or buffer where it does (name, shape, dtype, requires_grad),
        as PyTorch's _verify_param_shape_across_processes; the collective comes first, so
        nobody hangs. Buffers count when DDP sends them (broadcast_buffers/forward_sync)."""
        entries = [("parameter", n, list(p.shape), str(p.dtype), bool(p.requires_grad))
                   for n, p in self._named_synced("parameters")]
        if self._init_sync_buffers or self.forward_sync_buffers:
            entries += [("buffer", n, list(b.shape), str(b.dtype), False)
                        for n, b in self._named_synced("buffers")]
        group = self._private_group()
        everyone = [None] * group.size()
        # Each rank's node rides along (no extra collective): Note [Progress across nodes]
        here = progress.machine_id()
        dist.all_gather_object(everyone, (entries, MPI.Get_processor_name(), here),
                               group=group)  # timed, checked
        self.nodes = len({node for _, node, _ in everyone})
        progress.start_for_nodes(self.nodes, sum(m == here for _, _, m in everyone))
        everyone = [theirs for theirs, _, _ in everyone]
        reference, ranks = everyone[0], group.ranks
        for rank, theirs in zip(ranks, everyone):
            problem = _first_difference(theirs, reference, ranks[0])
            if problem is not None:
                raise ValueError("DistributedDataParallel expects the same model on every rank "
                                 "(every parameter and buffer it sends, in registration order): "
                                 f"rank {rank} {problem}. Build the same model on every rank "
                                 "(only values may differ: DDP starts from rank 0's)")

    def _sync_module_states(self):
        """Rank 0's parameters and buffers everywhere (a model may be initialized per rank);
        ``broadcast_buffers=False`` leaves rank-local buffers alone, as PyTorch's DDP."""
        self._broadcast_in_place(self._module_states(self._init_sync_buffers))

    def _init_buffer_options(self, broadcast_buffers, forward_sync_buffers):
        """PyTorch 2.13's two buffer options: ``forward_sync_buffers`` (rank 0's buffers before
        every forward; buffers are always synced at construction) and the deprecated
        ``broadcast_buffers`` (the same, but False also skips the construction-time sync)."""
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                              "`broadcast_buffers` is deprecated and its value is ignored when "
                              "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
            else:
                warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                              "instead. Unlike `broadcast_buffers=False`, "
                              "`forward_sync_buffers=False` still syncs buffers at construction.",
                              FutureWarning, stacklevel=3)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, self._init_sync_buffers = bool(forward_sync_buffers), True
        else:
            sync = True if broadcast_buffers is None else bool(broadcast_buffers)
            self.forward_sync_buffers = self._init_sync_buffers = sync
        self.broadcast_buffers = self.forward_sync_buffers  # the older name, still read by users

    def _module_states(self, buffers=True):
        buffers = [b for _, b in self._named_synced("buffers")] if buffers else []
        return [p for _, p in self._named_synced("parameters")] + buffers

    def _broadcast_in_place(self, tensors, src=0):
        """Every rank's ``tensors`` become those of group rank ``src``."""
        # MPI sends contiguous memory: a strided parameter (say, stored transposed) travels
        # as a contiguous copy and is written back, keeping its layout.
        staged = [(t, t.array if t.array.flags.c_contiguous
                   else backend.get_array_module(t.array).ascontiguousarray(t.array))
                  for t in tensors]
        group = self._private_group()
        works = [dist.broadcast(array, src=group.ranks[src], group=group, async_op=True)
                 for _, array in staged]
        for work in works:
            work.wait()
        for t, array in staged:
            if array is not t.array:
                t.array[...] = array

    def _sync_buffers(self):
        self._broadcast_in_place([b for _, b in self._named_synced("buffers")])

    # --- each iteration -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        syncing = grad_mode.is_grad_enabled() and self.require_backward_grad_sync
        joining = self._join_config.enable
        if self._own_group is None and (syncing or self.forward_sync_buffers or joining):
            self._private_group()  # an unpickled DDP's first collective
        self._syncing = syncing  # what _notify_not_joined announces
        active = Join.notify_join_context(self)
        if joining:
            self._joined_ever = True
        if syncing:
            self.reducer.prepare_for_forward()
            self._rebuild_buckets()
        if self.forward_sync_buffers:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if syncing:
            # The output sink, every iteration, for find_unused_parameters and static_graph,
            # whose sink queues the delayed reduction or the check (Note [Static graph]).
            sink = self._dynamic_unused or self.static_graph
            outputs = _find_tensors(output) if sink else ()
            self.reducer.prepare_for_backward(outputs if self._dynamic_unused else ())
            if sink:
                output = self._through_sink(output, outputs)
            self._trained += 1
        if active is not None:
            active.wait()  # a pending request must complete even when nobody needs its value
        return output

    @property
    def _dynamic_unused(self):
        """PyTorch's dynamic_graph_find_unused: a search for unused parameters every iteration."""
        return self.find_unused_parameters and not self.static_graph

    def _set_static_graph(self):
        """PyTorch's older spelling of ``static_graph=True``, before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.num_iterations:
            raise RuntimeError("_set_static_graph() must be called before the first forward "
                               "(the first iteration records the graph)")
        self.static_graph = True
        self.reducer.static_graph = True
        self.reducer.find_unused_parameters = False

    def _through_sink(self, output, tensors):
        tensors = list({id(t): t for t in tensors if t.requires_grad}.values())  # once each
        if not tensors:
            return output
        sunk = _DDPSink.apply(weakref.ref(self.reducer), *tensors)
        sunk = sunk if isinstance(sunk, tuple) else (sunk,)
        return _replace_tensors(output, {id(t): s for t, s in zip(tensors, sunk)})

    def _rebuild_buckets(self):
        # Decided locally (Reducer.should_rebuild_buckets): only once a backward has recorded
        # an order, on every rank alike, does this call a collective.
        if self.reducer.should_rebuild_buckets():
            self.reducer.rebuild_buckets()
        else:
            self.reducer.ensure_prior_reduction_finished()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally; the next synced backward reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):
        """``hook(state, bucket) -> Future`` replaces the all-reduce of each bucket.

        A sparse-gradient parameter's bucket holds its SparseCOOTensor gradient; the hook's
        Future then gives the reduced sparse gradient (comm_hooks.allreduce_hook handles both).
        """
        _check_comm_hook(hook)
        self.reducer.register_comm_hook(state, hook)

    # --- logging data ------------------------------------------------------------------------------
    def _get_ddp_logging_data(self):
        """PyTorch's DDP logging data, one dict (Note [DDP logging data] in reducer.py).

        PyTorch's key names, with Python values: ``bucket_sizes`` (bytes per bucket, as built at
        construction), ``has_rebuilt_buckets`` and ``rebuilt_bucket_sizes`` (after the first
        backward), ``bucket_cap_bytes``, ``find_unused_parameters``, ``unused_parameter_size``
        (bytes unused in the last iteration), ``comm_hook`` (the hook's name or None),
        ``gradient_as_bucket_view``, and the averages over synced iterations (but the first,
        which compiles kernels) ``avg_forward_compute_time``, ``avg_backward_compute_time``,
        ``avg_backward_comm_time`` and ``avg_backward_compute_comm_overlap_time`` in
        nanoseconds, as PyTorch's (``backward_compute_time``...: the last iteration's). Beyond
        PyTorch's: ``num_buckets``, ``bucket_num_parameters`` and
        ``rebuilt_bucket_num_parameters`` (parameters per bucket), ``unused_parameter_names``
        (every parameter this rank found unused so far). Local: no collective.
        """
        data = {"module_name": type(self.module).__name__,
                "rank": self.process_group.rank(),
                "backend_name": "mpi"}
        data.update(self.reducer.logging_data())
        data.update(broadcast_buffers=self.forward_sync_buffers, static_graph=self.static_graph,
                    join_uneven_inputs=self._joined_ever)
        return data

    # --- uneven inputs ----------------------------------------------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """Train on uneven inputs: a rank that runs out keeps matching the others' collectives.

        ``Join([self], ...)`` (Note [Join]), as PyTorch's. Each iteration the active ranks
        count themselves and say whether they sync gradients (no_sync() does not); a rank that
        has left the loop answers with zero gradients in the synced iterations until every rank
        is done, then all ranks take the model of the rank that trained longest. With
        ``divide_by_initial_world_size=False`` the gradient is averaged over the active ranks
        only. With ``throw_on_early_termination=True`` the first rank to run out raises
        instead, and so do the others at their next forward. To shadow a
        ZeroRedundancyOptimizer's step too: ``Join([ddp, zero])``.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    # Joinable (Note [Join]): DDP is the first joinable; its count says whether the iteration
    # syncs, and travels on DDP's own communicator.
    _must_be_first = True

    def join_hook(self, divide_by_initial_world_size=True, **kwargs):
        """The JoinHook that shadows this DDP's iterations (``Join(..., divide_by_initial_
        world_size=False)``: gradients averaged over the active ranks only)."""
        self._join_divide = divide_by_initial_world_size
        return _DDPJoinHook(self)

    @property
    def join_device(self):
        return next(iter(self.module.parameters())).device

    @property
    def join_process_group(self):
        return self.process_group

    def _join_group(self):
        return self._private_group()

    def _notify_not_joined(self, throw):
        """Count this iteration's active ranks and those syncing (joined ranks answer 0, 0).

        The count is left in flight (forward waits for it at its end); with
        throw_on_early_termination a second, blocking all-reduce hears whether some rank ran
        out, as PyTorch's Join.notify_join_context.
        """
        group = self._private_group()
        work = dist.all_reduce(np.array([1.0, float(self._syncing)]), group=group,
                               async_op=True)
        self.reducer.set_forward_pass_work_handle(None if self._join_divide else work)
        if throw:
            raise_if_a_rank_exhausted(group, work)
        return work

    def _count_not_joined(self):
        # [active ranks, ranks syncing gradients] of this iteration. Nonblocking, as the
        # active ranks' call: MPI never matches a blocking collective with a nonblocking one.
        counts = np.zeros(2)
        dist.all_reduce(counts, group=self._private_group(), async_op=True).wait()
        self._shadow_syncing = counts[1] > 0
        return int(counts[0])

    def _join_exit(self):
        # Outside join() the divisor is the world size again, not the last active count.
        self.reducer.set_forward_pass_work_handle(None)
        self._join_divide = True

    def _shadow_iteration(self, syncing):
        """The collectives of one iteration of the active ranks, with nothing to contribute.

        In a no_sync() iteration the active ranks reduce nothing, so neither does this rank
        (PyTorch's _check_global_requires_backward_grad_sync)."""
        if syncing:
            self._rebuild_buckets()
        if self.forward_sync_buffers:
            self._sync_buffers()
        if syncing:
            self.reducer.shadow_backward()

    def _sync_final_model(self):
        # Joined ranks stopped updating: the model to keep is one of a rank that trained the
        # most iterations itself (the lowest such rank), not of one that only shadowed them.
        group = self._private_group()
        size = group.size()
        mine = np.array([self._trained * size + (size - 1 - group.rank())])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        authority = size - 1 - int(mine[0] % size)
        self._broadcast_in_place(self._module_states(self.forward_sync_buffers), src=authority)


class _DDPJoinHook(JoinHook):
    """A joined rank's part in DDP's iterations (Note [Join])."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self):
        self.ddp._shadow_iteration(syncing=self.ddp._shadow_syncing)

    def post_hook(self, is_last_joiner):
        self.ddp._sync_final_model()
