"""The auto rule of the hierarchical all-reduce (Note [When hierarchical all-reduce pays]): across nodes
that are not consecutive blocks of ranks, from HPCGRAD_HIERARCHICAL_MIN_BYTES; results on cyclic fake nodes.

Multi-rank: ``mpiexec -n N python -m pytest --with-mpi tests/comm/test_hierarchical_rule.py``.
"""

import numpy as np
import pytest

from hpcgrad.comm import hierarchical
from hpcgrad.comm.mpi import comm_world
from hpcgrad.comm.process_group import ProcessGroup

TIMEOUT = 60.0


class Gathered:
    """A stand-in communicator whose allgather returns every rank's (node, ranks on node)."""

    def __init__(self, nodes):
        self.where = [(node, nodes.count(node)) for node in nodes]

    def allgather(self, _mine):
        return self.where


@pytest.mark.parametrize("nodes, want", [
    ([0, 0, 1, 1], True),            # mpiexec's and Slurm's default placement
    ([0, 0, 0, 0], True),            # one node
    ([0, 1, 2, 3], True),            # one rank per node
    ([0, 1, 0, 1], False),           # cyclic: rank r on node r % 2
    ([0, 0, 1, 1, 0, 0], False),     # node 0's ranks split in two runs
    ([0, 0, 0, 1], False),           # blocks of unequal size
])
def test_blocked_hand_checked(nodes, want):
    assert hierarchical.blocked(Gathered(nodes), None, None) is want


def test_default_threshold_is_the_measured_4_mib():
    assert hierarchical.min_bytes_from_env({}) == 4 << 20


def test_fake_placement_is_checked():
    assert hierarchical.fake_placement({}) == "block"
    assert hierarchical.fake_placement({hierarchical.FAKE_PLACEMENT_ENV: "Cyclic"}) == "cyclic"
    with pytest.raises(ValueError, match="HPCGRAD_FAKE_PLACEMENT must be block"):
        hierarchical.fake_placement({hierarchical.FAKE_PLACEMENT_ENV: "round-robin"})


def make_group(monkeypatch, placement, mode="auto", min_bytes=4096):
    monkeypatch.setenv(hierarchical.FAKE_NODES_ENV, "2")
    monkeypatch.setenv(hierarchical.FAKE_PLACEMENT_ENV, placement)
    monkeypatch.setenv(hierarchical.MIN_BYTES_ENV, str(min_bytes))
    monkeypatch.delenv(hierarchical.MODE_ENV, raising=False)
    return ProcessGroup(comm_world().Dup(), TIMEOUT, hierarchical=mode)


def fake_nodes(placement, size):
    return [r % 2 if placement == "cyclic" else r * 2 // size for r in range(size)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("placement", ["block", "cyclic"])
def test_auto_only_across_nodes_that_are_not_blocks(monkeypatch, placement):
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    nodes = fake_nodes(placement, size)
    group = make_group(monkeypatch, placement)
    try:
        hier = group._hier
        # block placement is blocks at any size (2 nodes of equal size when size is even;
        # odd sizes give unequal blocks); cyclic on 1 or 2 ranks is blocks too ([0] or [0, 1])
        blocks = size % 2 == 0 if placement == "block" else size <= 2
        if size == 1:
            blocks = True
        assert hier.node_index == nodes[rank] and hier.blocked is blocks
        spans_unblocked = len(set(nodes)) > 1 and not blocks
        assert hier.use(4096) is spans_unblocked and hier.use(4095) is False
        assert hier.use(1 << 30) is spans_unblocked
    finally:
        group.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("placement", ["block", "cyclic"])
def test_forced_hierarchical_on_cyclic_nodes_equals_the_sum(monkeypatch, placement):
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    group = make_group(monkeypatch, placement, mode="1")
    try:
        arrays = [np.arange(n, dtype=np.float32) + rank for n in (5, 3000, 70000)]
        works = [group.iallreduce(a) for a in arrays]
        for work in works:
            work.wait()
        for a in arrays:
            n = a.size
            want = size * np.arange(n, dtype=np.float32) + size * (size - 1) / 2
            np.testing.assert_array_equal(a, want)
    finally:
        group.free()
