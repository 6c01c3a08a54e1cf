"""Join, Joinable, JoinHook: training on uneven inputs (torch.distributed.algorithms.join).

Note [Join]
    A rank that runs out of inputs leaves the ``with Join([...]):`` loop while the others go on,
    so it must keep matching their collectives or they hang. Every iteration each active rank's
    first joinable announces itself (``Join.notify_join_context``, at the start of its
    per-iteration collectives: DDP's forward, ZeRO's step): one all-reduce of 1. A rank in
    ``Join.__exit__`` answers each with 0; a count above 0 means some rank is still training,
    and the joined rank runs every joinable's ``JoinHook.main_hook``, which shadows that
    joinable's collectives of one iteration (DDP: the gradient all-reduces with zeros; ZeRO: the
    parameter broadcasts of ``step``). A count of 0 means every rank has joined: each runs the
    ``post_hook``s (``is_last_joiner``: it never shadowed) and leaves. Only the first joinable
    counts, so every rank must pass the joinables in the same order.

    hpcgrad's additions, beside PyTorch's interface: the count travels on the communicator the
    first joinable names (``_join_group``: DDP's own duplicate, Note [DDP's own communicator]),
    and a joinable may carry more than the count in it (``_notify_not_joined`` /
    ``_count_not_joined``: DDP sends whether this iteration syncs gradients, as no_sync()
    iterations reduce nothing). A rank inside ``__exit__`` has joined: its joinables' notify is
    vacuous there (PyTorch's ZeRO main hook calls ``step``, which would announce it again).
"""

import abc
import warnings
from typing import NamedTuple

import numpy as np

from hpcgrad.collectives import api


def raise_if_a_rank_exhausted(group, work):
    """An active rank under ``throw_on_early_termination``: hear (the matching all-reduce of a
    joined rank's hook) whether some rank has run out; if so, finish ``work`` (this
    iteration's count, in flight) and raise on every rank."""
    exhausted = np.zeros(1)
    api.all_reduce(exhausted, group=group)
    if exhausted[0]:
        work.wait()
        raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across "
                           "all ranks.")


class JoinHook:
    """What a joined rank does for one joinable: ``main_hook`` while some rank still trains
    (shadow one iteration's collectives), ``post_hook(is_last_joiner)`` once all have joined."""

    def main_hook(self):
        """One iteration's collectives of the active ranks, matched with nothing to add."""

    def post_hook(self, is_last_joiner):
        """After every rank joined; ``is_last_joiner``: this rank never had to shadow."""


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def construct_disabled_join_config():
        return _JoinConfig(enable=False, throw_on_early_termination=False,
                           is_first_joinable=False)


class Joinable(abc.ABC):
    """A class whose per-iteration collectives a joined rank can shadow (Note [Join]).

    Subclasses call ``Joinable.__init__``, return a JoinHook from ``join_hook(**kwargs)``, name
    ``join_device`` and ``join_process_group``, and call ``Join.notify_join_context(self)``
    before each iteration's collectives.
    """

    _must_be_first = False  # DDP: its forward carries the count (and whether it syncs)

    def __init__(self):
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @abc.abstractmethod
    def join_hook(self, **kwargs):
        """The JoinHook of this joinable; ``kwargs`` are Join's extra keyword arguments."""

    @property
    @abc.abstractmethod
    def join_device(self):
        """The device of the join context's collectives."""

    @property
    @abc.abstractmethod
    def join_process_group(self):
        """The process group (None: the default one) of this joinable's collectives."""

    # --- the first joinable's collectives (hpcgrad; Note [Join]) -----------------------------
    def _join_group(self):
        return api._group(self.join_process_group)

    def _notify_not_joined(self, throw):
        """Active rank: count 1 (left in flight: the returned Work, also kept here, for a
        caller may drop it and a pending request must complete: waited at the next notify or
        when the context ends), then with ``throw`` hear whether some rank has joined."""
        self._wait_notified()
        group = self._join_group()
        work = self._join_pending = api.all_reduce(np.ones(1), group=group, async_op=True)
        if throw:
            raise_if_a_rank_exhausted(group, work)
        return work

    def _count_not_joined(self):
        """Joined rank: the matching count (nonblocking, as the active ranks' call: MPI never
        matches a blocking collective with a nonblocking one)."""
        count = np.zeros(1)
        api.all_reduce(count, group=self._join_group(), async_op=True).wait()
        return int(count[0])

    def _notify_terminate(self):
        """Joined rank with throw_on_early_termination: answer the active ranks' check."""
        group = self._join_group()
        api.all_reduce(np.ones(1), group=group)
        raise RuntimeError(f"Rank {group.rank()} exhausted all inputs.")

    def _wait_notified(self):
        work = self.__dict__.pop("_join_pending", None)
        if work is not None:
            work.wait()

    def _join_exit(self):
        """The join context ends (normally or by an exception): drop per-context state."""


class Join:
    """``with Join([ddp_model, zero_optimizer]):`` a rank that runs out of inputs shadows the
    others' collectives until all have run out (Note [Join]).

    Every rank passes the same joinables in the same order, all over one process group.
    ``throw_on_early_termination=True``: the first rank to run out raises, and the others at
    their next iteration. ``kwargs`` go to each ``join_hook`` (DDP takes
    ``divide_by_initial_world_size``).
    """

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        joinables = list(joinables)
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        for joinable in joinables:
            if not isinstance(joinable, Joinable):
                raise TypeError(f"Join expects Joinable objects (DistributedDataParallel, "
                                f"ZeroRedundancyOptimizer, or a Joinable subclass), got "
                                f"{type(joinable).__name__}")
            if not hasattr(joinable, "_join_config"):
                raise RuntimeError(f"Check that the {type(joinable).__name__} constructor calls "
                                   f"the ``Joinable`` constructor")
        for joinable in joinables[1:]:
            if joinable._must_be_first:
                raise ValueError(f"{type(joinable).__name__} must be the first joinable of "
                                 f"Join: its forward carries the per-iteration count; pass it "
                                 f"first, e.g. Join([ddp_model, zero_optimizer])")
        self._joinables = joinables
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._extract_dist_info()
        self._set_joinable_configs()

    def _set_joinable_configs(self):
        for i, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(
                enable=self._enable, throw_on_early_termination=self._throw_on_early_termination,
                is_first_joinable=i == 0)

    def _disable_joinable_configs(self):
        for joinable in self._joinables:
            joinable._join_config = _JoinConfig.construct_disabled_join_config()

    def _extract_dist_info(self):
        group = None
        for joinable in self._joinables:
            theirs = api._group(joinable.join_process_group)
            if group is None:
                group = theirs
            elif theirs is not group:
                raise ValueError("Using join context manager with multiple process groups")
        self._process_group = group
        self._rank = group.rank()
        self._device = self._joinables[0].join_device

    def __enter__(self):
        return self

    def __exit__(self, type, value, traceback):
        """Shadow the active ranks' iterations until every rank has joined, then run the post
        hooks. An exception inside the block propagates at once (nothing is shadowed)."""
        try:
            # This rank has joined: a notify from a main hook (ZeRO's step) is vacuous now.
            self._disable_joinable_configs()
            if not self._enable or type is not None:
                return
            first = self._joinables[0]
            first._wait_notified()  # this rank's last count, matched by every rank by now
            is_last_joiner = True
            shadowed = 0
            while first._count_not_joined() > 0:
                if shadowed == 1000:
                    warnings.warn(f"Detected uneven input skew of greater than 1000. This means "
                                  f"that rank {self._rank} has at least 1000 fewer inputs than "
                                  f"other currently-active ranks. This level of skew could lead "
                                  f"to performance degradation during training.", stacklevel=2)
                if self._throw_on_early_termination:
                    first._notify_terminate()
                for hook in self._join_hooks:
                    hook.main_hook()
                is_last_joiner = False
                shadowed += 1
            for hook in self._join_hooks:
                hook.post_hook(is_last_joiner)
        finally:
            for joinable in self._joinables:
                joinable._join_exit()

    @staticmethod
    def notify_join_context(joinable):
        """Tell the join context this rank has not joined (Note [Join]); call it before a
        joinable's per-iteration collectives. Only the first joinable of an enabled Join
        communicates: its Work (the count, in flight) is returned; otherwise None. With
        throw_on_early_termination it raises on every rank once one has joined."""
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise RuntimeError(f"Check that the {type(joinable).__name__} constructor calls the "
                               f"``Joinable`` constructor")
        if not config.is_first_joinable or not config.enable:
            return None
        return joinable._notify_not_joined(config.throw_on_early_termination)
