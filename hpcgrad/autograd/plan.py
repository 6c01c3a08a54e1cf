"""Replayed backward plans: the execution order of a graph whose structure repeats, kept and reused.

Note [Replayed backward plans]
Most training loops build the same graph every step: the same Node types, wired the same way,
created in the same order. The general engine (engine.py) rediscovers that every backward: it
counts dependencies into a dict, makes an InputBuffer and a NodeTask per Node, pushes and pops a
heap under a mutex. A plan keeps what that work finds, as positions instead of Nodes:

- ``types[i]``: the type of the i-th Node met breadth-first from the root (root is 0);
- ``edges[i]``: for each of its next edges, ``(j, input_nr)`` (j: the receiving Node's position)
  or None: this is the whole structure, sharing included (a Node reached twice has one position);
- ``order``: the positions in the order the general engine would run them. It is computed by
  simulating the engine's ready queue on the structure (dependency counts, then the greatest
  sequence number first, ties in push order), so it needs nothing recorded from a run;
- ``ranking``: the positions sorted by sequence number. The ready queue's choices depend only on
  how the sequence numbers compare, so a graph with the same structure and the same ranking (and
  the same count of distinct numbers, which keeps ties where they were: AccumulateGrad's are all
  equal) is run in the same order.

A later backward matches a plan by walking its graph breadth-first and comparing, Node by Node,
type, input count and edges with the plan; any difference ends the walk and a new plan is built.
The walk is the only per-Node cost left besides running the Node: no dependency counts, no ready
queue, no NodeTask, no lock; gradients go straight into the receiving position's list.

The key is what the plan fixes, and only that: the order and the wiring. Each Node then runs
through the one executor (Note [One executor] in executor.py), the same call the queue engine
makes, which reads everything else from the Node itself when it runs: hooks (added or removed
between iterations, as DDP's AccumulateGrad post-hooks), the receivers' input metadata (shape,
dtype, device, broadcast sum-back), which gradients are missing (an unused piece of ``chunk``),
keep_graph/create_graph and grad mode (from the GraphTask), anomaly mode, errors. So none of
those can be replayed stale, and none needs to be in the key. The input count must be in it: a
``chunk(3)`` graph otherwise matches a ``chunk(2)`` plan.

Where a plan is used (engine.Engine.execute): ``backward()`` without ``inputs=`` (the common
case; ``grad()`` and ``inputs=`` need exec_info and go to the queue engine), on a process
without GPUs (with GPUs, CPU and device work run on different threads), outside the pool threads
of deep reentrant backwards. There, every backward runs from a plan: a cached one its graph
matches, else one built for it (and cached: up to 4 per root type). Building and running a plan
once costs less than the queue engine (the walk that builds it replaces compute_dependencies,
and the simulation is cheaper than the queue), so a graph that never repeats gains too.
Plans are on by default because the fuzzer finds no difference between plans on, off and the
reference order: ``python -m tests.fuzz --programs 20000 --seed 1 --no-torch``.
``set_backward_plan("off")`` or ``HPCGRAD_BACKWARD_PLAN=0`` runs the queue engine only;
``"reference"`` the plain reference order (Note [The reference order]).

A replayed Node costs about 60% of the queue engine's instructions, ~4k of it the match walk:
Note [Where a Node's backward goes] in engine.py has the figures, the command that counts them
and where the rest goes.
"""

import heapq
import threading

from hpcgrad.base import config

MODES = ("on", "off", "reference")  # reference: Note [The reference order] (reference.py)
_MAX_PLANS_PER_ROOT = 4  # per root type: a loop alternating a few graphs keeps all of them


def _mode_from_env():
    value = config.raw("HPCGRAD_BACKWARD_PLAN").strip().lower() or "on"
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
    value = aliases.get(value, value)
    if value not in MODES:
        raise ValueError(f"HPCGRAD_BACKWARD_PLAN={value!r}: expected one of {', '.join(MODES)} "
                         "(or 1/0)")
    return value


class BackwardPlan:
    """The structure and execution order of one graph, by position (see the Note above).

    Besides the Note's fields: ``flat``, every Node's next edges in one list, position order,
    as (j, input_nr) or None; ``discover[i]``, where in ``flat`` the walk meets new Nodes from
    position i (for match); ``sizes[i]``, position i's input count; ``live[i]``, its next
    edges that are not None, as (k, j, input_nr): edge k of position i goes to input input_nr
    of position j (what a replay hands gradients along).
    """

    __slots__ = ("types", "edges", "sizes", "order", "ranking", "distinct",
                 "flat", "discover", "live")

    def __len__(self):
        return len(self.types)

    def __repr__(self):
        return f"<BackwardPlan of {len(self.types)} Nodes, root {self.types[0].__name__}>"


def _ranking(seqs):
    return sorted(range(len(seqs)), key=seqs.__getitem__)


def build(root):
    """Walk the graph under ``root`` and return its plan, with the Nodes in position order."""
    nodes, index = [root], {root: 0}
    edges, flat, discover = [], [], []
    pending = [0]  # edges into each position, for the ready-queue simulation below
    for fn in nodes:  # the list grows as the walk finds Nodes: breadth-first
        spec, found = [], []
        for edge in fn.next_edges:
            if edge is None:
                spec.append(None)
                flat.append(None)
                continue
            node = edge[0]
            j = index.get(node)
            if j is None:
                found.append(len(flat))
                j = index[node] = len(nodes)
                nodes.append(node)
                pending.append(1)
            else:
                pending[j] += 1
            spec.append((j, edge[1]))
            flat.append((j, edge[1]))
        edges.append(spec)
        discover.append(found)
    seqs = [fn.sequence_nr for fn in nodes]
    # Simulate the ready queue: a Node is ready when every edge into it has delivered; the
    # greatest sequence number runs first, ties in the order they became ready.
    heap, tiebreak, order = [(-seqs[0], 0, 0)], 1, []
    while heap:
        i = heapq.heappop(heap)[2]
        order.append(i)
        for e in edges[i]:
            if e is not None:
                j = e[0]
                pending[j] -= 1
                if pending[j] == 0:
                    heapq.heappush(heap, (-seqs[j], tiebreak, j))
                    tiebreak += 1
    plan = BackwardPlan()
    plan.types = list(map(type, nodes))
    plan.edges, plan.flat, plan.discover = edges, flat, discover
    plan.live = [tuple((k, e[0], e[1]) for k, e in enumerate(spec) if e is not None)
                 for spec in edges]
    plan.sizes = [len(fn.input_metadata) for fn in nodes]
    plan.order, plan.ranking, plan.distinct = order, _ranking(seqs), len(set(seqs))
    return plan, nodes


def match(plan, root):
    """The Nodes of ``root``'s graph in the plan's positions, or None if the graph differs.

    The walk only follows the edges where the plan met a new Node, gathering every Node's next
    edges into one list as it goes; then whole-list comparisons (in C) check the rest: the
    types, and every edge against the plan's (the same Node object at the same position, the
    same input number, None where None). Nodes must also be distinct: a graph that shares one
    Node where the plan has two of the same type would otherwise pass."""
    nodes, flat = [root], []
    append, extend = nodes.append, flat.extend
    try:
        for fn, discover in zip(nodes, plan.discover):  # zip follows the list's growth
            extend(fn.next_edges)
            for k in discover:
                append(flat[k][0])
    except (TypeError, IndexError):  # an edge is None, or missing, where the plan has one
        return None
    n = len(plan.types)
    if len(nodes) != n or list(map(type, nodes)) != plan.types or len(flat) != len(plan.flat):
        return None
    if flat != [None if e is None else (nodes[e[0]], e[1]) for e in plan.flat]:
        return None
    if len(set(nodes)) != n:
        return None
    # A Node's input count is structure too: a split into 3 pieces has a SplitBackward of 3
    # inputs where the plan's had 2, with the same edges out of it.
    if [len(fn.input_metadata) for fn in nodes] != plan.sizes:
        return None
    seqs = [fn.sequence_nr for fn in nodes]
    if len(set(seqs)) != plan.distinct or _ranking(seqs) != plan.ranking:
        return None
    return nodes


class PlanCache:
    """Plans by root type, most recently used first; counts what happened, for tests and benchmarks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._plans = {}    # type of root -> [BackwardPlan, ...]
        self.mode = _mode_from_env()
        self.stats = {"replayed": 0, "built": 0, "general": 0}

    def set_mode(self, mode):
        if mode is True or mode is False:
            mode = "on" if mode else "off"
        if mode not in MODES:
            raise ValueError(f"set_backward_plan: expected one of {', '.join(MODES)} or a bool, "
                             f"got {mode!r}")
        previous, self.mode = self.mode, mode
        if mode == "off":
            self.clear()
        return previous

    def clear(self):
        with self._lock:
            self._plans.clear()
            self.stats = dict.fromkeys(self.stats, 0)

    def lookup(self, root):
        """``(plan, nodes)`` for a graph matching a cached plan, else None."""
        plans = self._plans.get(type(root))
        if not plans:
            return None
        for k, plan in enumerate(plans):
            nodes = match(plan, root)
            if nodes is not None:
                if k:
                    with self._lock:  # most recently used first
                        if plan in plans:
                            plans.remove(plan)
                            plans.insert(0, plan)
                return plan, nodes
        return None

    def plan_for(self, root):
        """``(plan, nodes)`` for ``root``'s graph: a cached plan it matches, else a new one."""
        found = self.lookup(root)
        if found is not None:
            self.stats["replayed"] += 1
            return found
        plan, nodes = build(root)
        self.add(plan)
        return plan, nodes

    def add(self, plan):
        with self._lock:
            plans = self._plans.setdefault(plan.types[0], [])
            plans.insert(0, plan)
            del plans[_MAX_PLANS_PER_ROOT:]
            self.stats["built"] += 1
