"""State: what a training function needs to go on after the world changed, kept in memory by
``commit()`` and put back by ``restore()`` (Horovod Elastic's State, torchelastic's names).

Note [ZeRO under elastic.run]
    A ZeroRedundancyOptimizer keeps on each rank the optimizer state of its shard only, so a
    lost rank takes its shard with it. So at ``commit()`` every rank gathers every shard
    (``gather_state_dict``, a collective: the commit is already called by every rank at the
    same step) and keeps the whole optimizer state, in ``state_dict()``'s unsharded layout,
    in the commit. After a change of the world the
    survivors re-partition the parameters over the new default group (``_repartition``: the
    same object, its local optimizer built again over the new shard, so ``state.optimizer``
    keeps its identity) and ``restore`` loads the whole committed state, each rank keeping
    its new shard's part. Any number of lost ranks is survived, and a planned departure goes
    through the same path, so the two are equal bit for bit (tests/elastic/test_zero_syncbn.py).

    The price is the commit. Memory: every rank holds the whole optimizer state in each
    commit it keeps (``KEEP`` = 2), as with a plain optimizer, where ZeRO's live state is 1/N
    of it: at 4 ranks the two commits hold 8 times ZeRO's live state. Time: the commit is a
    collective that moves the whole state to every rank (the lengths all-gathered, then one
    broadcast per rank of exactly its pickled shard; ``all_gather_object``'s equal padded
    blocks moved N times the largest shard and took twice as long). Measured here (4 ranks
    on 2 loaded cores, MPICH, an MLP, Adam, medians of 10 commits): 0.40 M parameters, a
    commit 28 ms under ZeRO against 2.3 ms with plain Adam (a step: 35-45 ms; ZeRO's live
    state 0.76 MiB a rank, each commit 3.05 MiB); 1.32 M parameters, 58-115 ms against
    12-17 ms (a step: 75-130 ms; 2.5 MiB live, 10.1 MiB a commit). So under ZeRO a commit
    costs about a step here, 10 % at ``--commit-every 10``.

    Rejected: each rank keeping a copy of its ring neighbour's shard (2/N of the state a
    commit, one exchange with a neighbour) loses a shard when a rank and its neighbour die
    together (both ranks of a node, which tests/elastic/ kills), and survivors would still
    have to fetch the lost shards from their holders after the change. The gather survives
    any set of lost ranks with no communication during the recovery.

    Only the default group: a ZeroRedundancyOptimizer or a SyncBatchNorm over another group is
    refused (those groups are not rebuilt after a shrink). A SyncBatchNorm with
    ``process_group=None`` resolves the default group at every forward, so it follows the
    shrunk world with nothing rebuilt; its running statistics are buffers, in the model's
    state_dict and so in the commit.
"""

import collections
import copy

from hpcgrad.collectives import api
from hpcgrad.ddp.data_parallel import DistributedDataParallel
from hpcgrad.ddp.sync_batchnorm import SyncBatchNorm
from hpcgrad.dist_optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from hpcgrad.elastic.runner import LeaveRequest

# Commits kept: the newest, and the one before it, since a rank that died inside a step may
# leave some survivors one commit ahead of the others (Note [Agreeing on a commit]).
KEEP = 2


class State:
    """Model, optimizer, sampler position, epoch, step and the user's objects.

    ``model``: the plain module; ``state.ddp`` is DistributedDataParallel over it on the
    current world, built on first use with ``ddp_kwargs`` and built again after each change
    of the world (the old one's hooks removed). ``sampler``: an ElasticSampler, re-sharded
    for the new world. ``epoch`` and ``step`` start at 0; every other keyword becomes an
    attribute (``state.best_loss``) that ``commit`` copies and ``restore`` puts back.

    ``commit()`` (every rank, at the same step) copies all of it in memory, no disk;
    ``restore()`` puts the newest commit back. After a lost rank, the survivors restore the
    newest commit all of them hold, so what was done after it is done again.

    A ZeroRedundancyOptimizer over the default group is protected by gathering its shards at
    each commit (collective) and re-partitioning it over the new world after a change, the
    same object (Note [ZeRO under elastic.run]); SyncBatchNorm layers must use the default
    group (``process_group=None``).
    """

    def __init__(self, model, optimizer=None, sampler=None, ddp_kwargs=None, **objects):
        if isinstance(model, DistributedDataParallel):
            raise TypeError("elastic.State takes the plain module, not DistributedDataParallel: "
                            "state.ddp wraps it on the current world and again after a change")
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            if optimizer.process_group is not api._group(None):
                raise NotImplementedError(
                    f"elastic.State with a ZeroRedundancyOptimizer over a group other than the "
                    f"default one (ranks {list(optimizer.process_group.ranks)}) is not built: "
                    f"only the default group is rebuilt after a change of the world; build it "
                    f"with process_group=None")
        for name, module in model.named_modules():
            if isinstance(module, SyncBatchNorm) and module.process_group is not None:
                raise NotImplementedError(
                    f"elastic.State: SyncBatchNorm {name or '(the model)'!r} has an explicit "
                    f"process_group; under elastic.run only the default group is rebuilt after "
                    f"a change of the world, and this layer would keep the old one. Build it "
                    f"with process_group=None (the default group, resolved at each forward), "
                    f"e.g. SyncBatchNorm.convert_sync_batchnorm(model) without a group")
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.epoch, self.step = 0, 0
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._ddp = None
        self._objects = sorted(objects)
        for name, value in objects.items():
            setattr(self, name, value)
        self._commits = collections.deque(maxlen=KEEP)
        self._serial = 0  # commits made (the same count on every rank)

    # --- DDP on the current world -------------------------------------------------------
    @property
    def ddp(self):
        """DistributedDataParallel over ``model`` on the current default group (collective
        on first use after each change of the world: every rank reads it at the same point)."""
        if self._ddp is None:
            self._ddp = DistributedDataParallel(self.model, **self._ddp_kwargs)
        return self._ddp

    def _drop_ddp(self):
        """Forget the DDP of the old world; its hooks must not mark the model's parameters
        for a reducer whose communicator is gone."""
        if self._ddp is not None:
            self._ddp.reducer.remove_hooks()
            self._ddp = None

    def _ddp_groups(self):
        if self._ddp is None:
            return []
        return [g for g in (self._ddp._own_group, self._ddp.process_group) if g is not None]

    def _repartition(self):
        """Follow the new default group with what holds a group: ZeRO's shards (Note [ZeRO
        under elastic.run]); the state to load comes with ``restore``. No communication."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer._repartition(None)

    def leave(self, ranks):
        """Shrink the world by plan: every rank calls this at the same step, inside the function
        ``elastic.run`` decorated; the world ranks in ``ranks`` return None from it, the others
        go on over the rest of the world from the newest commit (Note [Elastic run])."""
        raise LeaveRequest(ranks)

    # --- commits -------------------------------------------------------------------------
    def _optimizer_state(self):
        if self.optimizer is None:
            return None
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):  # collective, a private copy
            return self.optimizer.gather_state_dict()
        return copy.deepcopy(self.optimizer.state_dict())

    def _snapshot(self):
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": self._optimizer_state(),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "epoch": self.epoch, "step": self.step,
            "objects": copy.deepcopy({name: getattr(self, name) for name in self._objects}),
        }

    def commit(self):
        """Keep a copy of the whole state in memory (every rank, at the same step; collective
        with a ZeroRedundancyOptimizer, whose shards it gathers)."""
        snapshot = self._snapshot()  # first: a failure in ZeRO's gather counts no commit
        self._serial += 1
        self._commits.append((self._serial, snapshot))

    def commits(self):
        """The serial numbers of the commits held, oldest first."""
        return [serial for serial, _ in self._commits]

    def restore(self, serial=None):
        """Put back commit ``serial`` (default: the newest); gradients are cleared."""
        if not self._commits:
            raise RuntimeError("elastic.State.restore: nothing committed yet; call "
                               "state.commit() first (elastic.run commits once on entry)")
        held = dict(self._commits)
        if serial is None:
            serial = self._commits[-1][0]
        if serial not in held:
            raise KeyError(f"commit {serial} is not held here (held: {sorted(held)})")
        snap = held[serial]
        self.model.load_state_dict(copy.deepcopy(snap["model"]))
        for p in self.model.parameters():
            p.grad = None
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.load_state_dict(snap["optimizer"])  # copies its shard's part only
        elif self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        if self.sampler is not None:
            self.sampler.load_state_dict(snap["sampler"])
        self.epoch, self.step = snap["epoch"], snap["step"]
        for name, value in copy.deepcopy(snap["objects"]).items():
            setattr(self, name, value)
        # Commits newer than the one restored describe a future that is now undone.
        while self._commits and self._commits[-1][0] > serial:
            self._commits.pop()
        self._serial = serial
