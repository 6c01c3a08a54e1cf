"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO stage 1), as PyTorch's.

Note [ZeRO partition]
    Every rank holds every parameter and gradient, but only its shard's optimizer state (Adam's
    two moments are twice the model: with N ranks each keeps about 1/N of them). The shard is
    PyTorch's greedy partition: per parameter group, parameters largest first (a stable sort,
    so equal sizes keep their order), each to the rank with the fewest elements so far (the
    lowest rank on a tie), the running totals carried from one group to the next. Each rank
    builds the same partition from the same parameter list, so no communication decides it.
    ``step`` runs a local ``optimizer_class`` over this rank's shard, then every parameter is
    broadcast from its owner (one broadcast per parameter, or per rank with
    ``parameters_as_bucket_view``, where each rank's parameters are views into one flat
    buffer). The local optimizer sees exactly the arrays and gradients the unsharded optimizer
    would, so the parameters equal the unsharded run's bit for bit.
"""

import copy
import pickle

import numpy as np

from hpcgrad.base import backend
from hpcgrad.optim.optimizer import Optimizer
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.collectives import api
from hpcgrad.collectives.join import Join, JoinHook, Joinable


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """``ZeroRedundancyOptimizer(params, optim.Adam, lr=1e-3)``: ``optimizer_class`` steps
    this rank's shard only (Note [ZeRO partition]); ``**defaults`` go to it.

    ``param_groups`` are the full groups (every parameter; change ``lr`` there, as a scheduler
    does, and the local optimizer follows at the next ``step``); ``state`` (the local
    optimizer's) holds this rank's shard only. ``state_dict()`` needs
    ``consolidate_state_dict(to)`` first, on every rank, and then works on rank ``to`` only; it
    has the unsharded optimizer's layout, so ``load_state_dict`` takes it at any world size
    (or a plain optimizer's), each rank keeping its own shard. Every rank of ``process_group``
    (None: the default group) calls ``step``, ``consolidate_state_dict``,
    ``gather_state_dict`` and ``add_param_group`` at the same point: they communicate or must
    agree.

    Uneven inputs: ``with Join([ddp_model, zero]):`` a rank that ran out takes part in every
    later ``step`` of the others (its shard stepped with the gradients its DDP shadowed, and
    the broadcasts), as PyTorch's ``join_hook`` (Note [Join]).
    """

    def __init__(self, params, optimizer_class, process_group=None,
                 parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults):
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not built: it runs each "
                "shard's step inside DDP's comm hook as the gradient buckets arrive (PyTorch's "
                "hook_with_zero_step), which hpcgrad's DDP does not offer yet; leave it False "
                "and call step() after backward")
        groups, self._all_params = _verify_params(params)
        _verify_same_dense_param_type(self._all_params)
        Joinable.__init__(self)
        self.initialized = False  # add_param_group, called by Optimizer.__init__, checks it
        self._partition_cache = []
        self._all_state_dicts = []
        self._buckets = []
        super().__init__(groups, defaults)
        self.process_group = api._group(process_group)
        self.world_size, self.rank = self.process_group.size(), self.process_group.rank()
        self.global_rank = self.process_group.ranks[self.rank]
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optim_defaults = defaults
        self.optim = optimizer_class(self._partition_parameters()[self.rank], **defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        if parameters_as_bucket_view:
            self._build_param_buckets()
        self.initialized = True

    # --- the local shard's state ---------------------------------------------------------------
    @property
    def state(self):
        """The local optimizer's state: this rank's shard only (empty before construction ends)."""
        optim = self.__dict__.get("optim")
        return self.__dict__["_state"] if optim is None else optim.state

    @state.setter
    def state(self, value):
        optim = self.__dict__.get("optim")
        if optim is None:  # Optimizer.__init__ assigns it before the local optimizer exists
            self.__dict__["_state"] = value
        else:
            optim.state = value

    # --- partition ---------------------------------------------------------------------------
    def _partition_parameters(self):
        """Per rank, a list with one group dict per parameter group (its params possibly
        empty): PyTorch's greedy, largest-first partition (Note [ZeRO partition])."""
        if not self._partition_cache:
            per_rank = [[] for _ in range(self.world_size)]
            sizes = [0] * self.world_size
            for group in self.param_groups:
                shards = [[] for _ in range(self.world_size)]
                for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                    rank = sizes.index(min(sizes))
                    shards[rank].append(p)
                    sizes[rank] += p.numel()
                for rank, shard in enumerate(shards):
                    per_rank[rank].append(dict(group, params=shard))
            self._partition_cache = per_rank
            self._param_to_rank = {id(p): rank for rank, groups in enumerate(per_rank)
                                   for g in groups for p in g["params"]}
            params = [p for g in self.param_groups for p in g["params"]]
            self._index_to_param = dict(enumerate(params))
            self._param_to_index = {id(p): i for i, p in enumerate(params)}
        return self._partition_cache

    def _clear_cache(self):
        self._partition_cache = []

    @staticmethod
    def _sync_param_groups(src, dst):
        """Copy every option (all but ``params``) of each group of ``src`` into ``dst``'s."""
        for src_group, dst_group in zip(src, dst):
            for key, value in src_group.items():
                if key != "params":
                    dst_group[key] = value

    def add_param_group(self, param_group):
        """Add a group to the full optimizer and this rank's share of it to the local one. The
        earlier groups keep their owners (the greedy partition is built group by group)."""
        super().add_param_group(param_group)
        if self.initialized:
            self._all_params = [p for g in self.param_groups for p in g["params"]]
            _verify_same_dense_param_type(self._all_params)
            self._clear_cache()
            self.optim.add_param_group(self._partition_parameters()[self.rank][-1])
            self._sync_param_groups(self.optim.param_groups, self.param_groups)
            if self.parameters_as_bucket_view:
                self._build_param_buckets()

    def _build_param_buckets(self):
        """Each rank's parameters become views into one flat buffer, broadcast in one call."""
        self._buckets = []
        for groups in self._partition_parameters():
            params = [p for g in groups for p in g["params"]]
            if not params:  # a rank with nothing to own still joins the broadcasts
                xp = backend.get_array_module(self._all_params[0].array)
                self._buckets.append(xp.zeros(1, self._all_params[0].dtype))
                continue
            xp = backend.get_array_module(params[0].array)
            bucket = xp.empty(sum(p.numel() for p in params), params[0].dtype)
            offset = 0
            for p in params:
                view = bucket[offset:offset + p.numel()].reshape(p.shape)
                view[...] = p.array
                p.array = view
                offset += p.numel()
            self._buckets.append(bucket)

    # --- stepping ----------------------------------------------------------------------------
    def step(self, closure=None, **kwargs):
        """Step this rank's shard with the local optimizer, then bring every rank every
        updated parameter (broadcasts from the owners). Returns ``closure()``'s loss if given."""
        Join.notify_join_context(self)  # a Join's count, when this is its first joinable
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = (self.optim.step(**kwargs) if closure is None
                else self.optim.step(closure=closure, **kwargs))
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _sync_params(self):
        works = []
        group = self.process_group
        if self.parameters_as_bucket_view:
            for rank, bucket in enumerate(self._buckets):
                works.append(api.broadcast(bucket, group.ranks[rank], group, async_op=True))
        else:
            for rank, groups in enumerate(self._partition_parameters()):
                for g in groups:
                    for p in g["params"]:
                        works.append(api.broadcast(p.array, group.ranks[rank], group,
                                                   async_op=True))
        for work in works:
            work.wait()

    # --- Joinable (Note [Join]) ------------------------------------------------------------------
    def join_hook(self, **kwargs):
        """The JoinHook that runs ``step`` on a joined rank while others still train: its
        shard is stepped (with the gradients its DDP's join hook shadowed) and broadcast."""
        return _ZeROJoinHook(self)

    @property
    def join_device(self):
        return self._all_params[0].device

    @property
    def join_process_group(self):
        return self.process_group

    # --- checkpoints -------------------------------------------------------------------------
    def consolidate_state_dict(self, to=0):
        """Collect every rank's shard of the state on rank ``to`` (a group rank), for
        ``state_dict()`` there. Every rank of the group calls it. Rank ``to`` then holds a host
        copy of the whole state (the unsharded optimizer's size) until the next call."""
        if not (isinstance(to, int) and 0 <= to < self.world_size):
            raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of the group "
                             f"(0..{self.world_size - 1})")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._all_state_dicts = []
        group = self.process_group
        local = _to_host(self.optim.state_dict())
        for rank in range(self.world_size):
            if rank == to:
                if self.rank == to:
                    self._all_state_dicts.append(local)
            elif self.rank == rank:
                _send_object(local, group.ranks[to], group)
            elif self.rank == to:
                self._all_state_dicts.append(_recv_object(group.ranks[rank], group))

    def state_dict(self):
        """The whole optimizer's state (the unsharded optimizer's layout) as of the last
        ``consolidate_state_dict``, on the rank it consolidated to."""
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                "to save the global state.")
        return self._whole_state_dict(self._all_state_dicts)

    def _whole_state_dict(self, shards):
        """The unsharded optimizer's state dict from every rank's local state dict (rank
        order), as the current partition assigns them."""
        groups = []
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = [self._param_to_index[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {}
        for rank, local in enumerate(shards):
            shard_groups = self._partition_parameters()[rank]
            for local_group, shard in zip(local["param_groups"], shard_groups):
                for local_index, p in zip(local_group["params"], shard["params"]):
                    if local_index in local["state"]:
                        state[self._param_to_index[id(p)]] = local["state"][local_index]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Load this rank's shard of a whole-optimizer state dict (from ``state_dict()`` at any
        world size, or from the unsharded optimizer) and every group's options."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"expected a dict with keys 'state' and 'param_groups' (from "
                             f"state_dict()), got {keys}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups: "
                             f"{len(saved_groups)} saved, {len(self.param_groups)} in this "
                             f"optimizer")
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't "
                                 f"match the size of optimizer's group: group {i} has "
                                 f"{len(saved['params'])} parameters saved, "
                                 f"{len(group['params'])} here")
        # Saved indices -> parameters, as Optimizer.load_state_dict pairs them.
        by_saved_index = {index: p for group, saved in zip(self.param_groups, saved_groups)
                          for index, p in zip(saved["params"], group["params"])}
        local_index = {id(p): i for i, p in enumerate(
            p for g in self.optim.param_groups for p in g["params"])}
        local_state = {}
        for key, value in state_dict["state"].items():
            p = by_saved_index.get(int(key))
            if p is None:
                raise ValueError(f"loaded state dict has state for parameter {key}, which no "
                                 f"parameter group lists")
            # Every rank checks every entry, so a wrong checkpoint fails on all ranks alike.
            for name, item in value.items():
                shape = getattr(item.array if isinstance(item, Tensor) else item, "shape", None)
                if shape not in (None, (), tuple(p.shape)):
                    raise ValueError(f"loaded state dict has {name!r} of shape {tuple(shape)} "
                                     f"for parameter {key}, but that parameter has shape "
                                     f"{tuple(p.shape)}; was it saved from a different model?")
            if self._param_to_rank[id(p)] == self.rank:
                local_state[local_index[id(p)]] = value
        local_groups = []
        for saved, shard in zip(saved_groups, self.optim.param_groups):
            options = {key: value for key, value in saved.items() if key != "params"}
            local_groups.append({**options, "params": [local_index[id(p)]
                                                       for p in shard["params"]]})
        # The local optimizer copies the arrays and checks the shapes.
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    # --- elastic.run (Note [ZeRO under elastic.run] in hpcgrad/elastic/state.py) -------------
    def gather_state_dict(self):
        """The whole optimizer's state (``state_dict()``'s layout) on every rank: each rank's
        shard all-gathered. Every rank of the group calls it at the same point. The result is
        a private host copy of the whole state (the unsharded optimizer's size) on each rank;
        nothing is kept here (``state_dict()`` still needs ``consolidate_state_dict``)."""
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        shards = _all_gather_objects(_to_host(self.optim.state_dict()), self.process_group)
        whole = self._whole_state_dict(shards)
        whole["param_groups"] = copy.deepcopy(whole["param_groups"])  # options, not live ones
        return whole

    def _repartition(self, process_group=None):
        """Partition the parameters again over ``process_group`` (None: the default group,
        e.g. the world ``elastic.run`` shrank): a new local optimizer over this rank's new
        shard, with every group's current options and no state. Then ``load_state_dict`` of
        the whole state gives each rank its new shard's state. No communication."""
        self.process_group = api._group(process_group)
        self.world_size, self.rank = self.process_group.size(), self.process_group.rank()
        self.global_rank = self.process_group.ranks[self.rank]
        self._clear_cache()
        self._all_state_dicts = []
        # The partition's groups carry the full groups' options (a scheduler's lr included).
        self.optim = self.optimizer_class(self._partition_parameters()[self.rank],
                                          **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        if self.parameters_as_bucket_view:
            self._build_param_buckets()


class _ZeROJoinHook(JoinHook):
    def __init__(self, zero):
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError("ZeRO join hook requires passing in a ZeroRedundancyOptimizer "
                            f"instance as the state, got {type(zero).__name__}")
        self.zero = zero

    def main_hook(self):
        """One step of this rank's shard and the broadcasts of every shard, as the active
        ranks' step (Note [Join])."""
        self.zero.step()


# --- helpers -----------------------------------------------------------------------------------
def _verify_params(params):
    """(groups as the Optimizer takes them, every parameter in a flat list), PyTorch's checks."""
    if isinstance(params, Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got "
                        f"{type(params).__name__}")
    try:
        groups = list(params)
    except TypeError:
        raise TypeError(f"`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{type(params).__name__}") from None
    if not groups:
        raise ValueError("ZeroRedundancyOptimizer did not receive any parameters")
    if all(isinstance(p, Tensor) for p in groups):
        return groups, list(groups)
    if not all(isinstance(g, dict) for g in groups):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts (parameter "
                        "groups), not a mix")
    flat = []
    for g in groups:
        if "params" not in g:
            raise ValueError("Each parameter group passed-in via `params` must have a 'params' "
                             "key mapping to the parameters in the group")
        flat.extend([g["params"]] if isinstance(g["params"], Tensor) else g["params"])
    return groups, flat


def _verify_same_dense_param_type(params):
    """One dtype and one device for all parameters, as PyTorch's ZeRO requires."""
    if not params:
        return
    kinds = {(str(p.dtype), str(p.device)) for p in params if isinstance(p, Tensor)}
    if len(kinds) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for "
                         f"all parameters but got {sorted(kinds)} (dtype, device); convert the "
                         f"model to one dtype first (e.g. model.double())")


def _to_host(obj):
    """A copy of a state dict with every array on the host (what travels and is saved)."""
    if isinstance(obj, dict):
        return {key: _to_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(value) for value in obj)
    if isinstance(obj, Tensor):
        obj = obj.array
    if isinstance(obj, np.ndarray) or backend.is_gpu_array(obj):
        return np.array(backend.to_device(obj, backend.CPU), copy=True)
    return copy.deepcopy(obj)


def _send_object(obj, dst, group):
    payload = np.frombuffer(bytearray(pickle.dumps(obj)), np.uint8)
    api.send(np.array([payload.size], np.int64), dst, group)
    api.send(payload, dst, group)


def _recv_object(src, group):
    length = np.empty(1, np.int64)
    api.recv(length, src, group)
    payload = np.empty(int(length[0]), np.uint8)
    api.recv(payload, src, group)
    return pickle.loads(payload.tobytes())


def _all_gather_objects(obj, group):
    """Every rank's ``obj``, in rank order, on every rank: the lengths all-gathered, then one
    broadcast per rank of exactly its bytes. Not all_gather_object, whose equal padded blocks
    move N times the largest shard (ZeRO's shards are uneven: twice as slow here)."""
    mine = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                         np.uint8)
    lengths = np.empty(group.size(), np.int64)
    api.all_gather_into_tensor(lengths, np.array([mine.size], np.int64), group)
    payloads = [mine if rank == group.rank() else np.empty(int(n), np.uint8)
                for rank, n in enumerate(lengths)]
    works = [api.broadcast(payload, group.ranks[rank], group, async_op=True)
             for rank, payload in enumerate(payloads)]
    for work in works:
        work.wait()
    return [pickle.loads(payload) for payload in payloads]
