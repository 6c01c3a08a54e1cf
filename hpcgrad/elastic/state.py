"""State: what a training function needs to go on after the world changed, kept in memory by
``commit()`` and put back by ``restore()`` (Horovod Elastic's State, torchelastic's names)."""

import collections
import copy

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

    Not built: ZeroRedundancyOptimizer (its shards would have to be re-partitioned over the
    new world) and SyncBatchNorm (its statistics group would have to follow the new world)
    are refused with NotImplementedError.
    """

    def __init__(self, model, optimizer=None, sampler=None, ddp_kwargs=None, **objects):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise NotImplementedError(
                "elastic.State with ZeroRedundancyOptimizer is not built yet: its optimizer "
                "state is sharded by rank, and after a lost rank the lost shard would have to "
                "be rebuilt and every shard re-partitioned over the new world; use a plain "
                "optimizer (each rank keeps the whole state)")
        if any(isinstance(m, SyncBatchNorm) for m in model.modules()):
            raise NotImplementedError(
                "elastic.State with SyncBatchNorm is not built yet: its statistics group is "
                "fixed when the layer is built and would have to move to the shrunk world; "
                "use BatchNorm (per-rank statistics) under elastic.run")
        if isinstance(model, DistributedDataParallel):
            raise TypeError("elastic.State takes the plain module, not DistributedDataParallel: "
                            "state.ddp wraps it on the current world and again after a change")
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

    def leave(self, ranks):
        """Shrink the world by plan: every rank calls this at the same step, inside the function
        ``elastic.run`` decorated; the world ranks in ``ranks`` return None from it, the others
        go on over the rest of the world from the newest commit (Note [Elastic run])."""
        raise LeaveRequest(ranks)

    # --- commits -------------------------------------------------------------------------
    def _snapshot(self):
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": (copy.deepcopy(self.optimizer.state_dict())
                          if self.optimizer is not None else None),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "epoch": self.epoch, "step": self.step,
            "objects": copy.deepcopy({name: getattr(self, name) for name in self._objects}),
        }

    def commit(self):
        """Keep a copy of the whole state in memory (every rank, at the same step)."""
        self._serial += 1
        self._commits.append((self._serial, self._snapshot()))

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
        if self.optimizer is not None:
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
