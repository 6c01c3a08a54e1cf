"""Hierarchical all-reduce (Note [Hierarchical all-reduce]): the rule, the node layout, and results
equal to the flat all_reduce's and to hand-computed ones at 1, 2 and 3 ranks, on 1 and 2 fake nodes.

Multi-rank: ``mpiexec -n N python -m pytest --with-mpi tests/comm/test_hierarchical.py``. Each test
builds its own groups over a duplicate of the world, so the env it sets is read at construction.
"""

import numpy as np
import pytest

from hpcgrad import info
from hpcgrad.comm import hierarchical
from hpcgrad.comm.mpi import MPI, comm_world
from hpcgrad.comm.process_group import ProcessGroup, ReduceOp

TIMEOUT = 60.0
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


# --- serial: the settings ---------------------------------------------------------------------
def test_mode_defaults_to_off_and_rejects_other_words():
    assert hierarchical.mode_from_env({}) == "0"
    assert hierarchical.mode_from_env({hierarchical.MODE_ENV: "AUTO"}) == "auto"
    with pytest.raises(ValueError, match="HPCGRAD_HIERARCHICAL_ALLREDUCE must be 0"):
        hierarchical.mode_from_env({hierarchical.MODE_ENV: "yes"})


def test_min_bytes_and_fake_nodes_are_checked():
    assert hierarchical.min_bytes_from_env({}) == 4 << 20
    assert hierarchical.min_bytes_from_env({hierarchical.MIN_BYTES_ENV: "4096"}) == 4096
    with pytest.raises(ValueError, match="HPCGRAD_HIERARCHICAL_MIN_BYTES must be"):
        hierarchical.min_bytes_from_env({hierarchical.MIN_BYTES_ENV: "1MB"})
    assert hierarchical.fake_nodes({}) is None
    assert hierarchical.fake_nodes({hierarchical.FAKE_NODES_ENV: "2"}) == 2
    with pytest.raises(ValueError, match="HPCGRAD_FAKE_NODES must be a node count >= 1"):
        hierarchical.fake_nodes({hierarchical.FAKE_NODES_ENV: "0"})


def test_the_default_group_builds_nothing(monkeypatch):
    monkeypatch.delenv(hierarchical.MODE_ENV, raising=False)
    group = ProcessGroup(MPI.COMM_SELF.Dup(), TIMEOUT)
    try:
        assert group._hier is None
    finally:
        group.free()


def test_a_bad_option_is_refused():
    with pytest.raises(ValueError, match="hierarchical must be '0', '1' or 'auto'"):
        ProcessGroup(MPI.COMM_SELF.Dup(), TIMEOUT, hierarchical="on")


# --- ranks: layout, rule and results ----------------------------------------------------------
def make_group(monkeypatch, fake, mode, by_env, min_bytes=None):
    monkeypatch.setenv(hierarchical.FAKE_NODES_ENV, str(fake))
    if min_bytes is not None:
        monkeypatch.setenv(hierarchical.MIN_BYTES_ENV, str(min_bytes))
    if by_env:
        monkeypatch.setenv(hierarchical.MODE_ENV, mode)
        return ProcessGroup(comm_world().Dup(), TIMEOUT)
    monkeypatch.delenv(hierarchical.MODE_ENV, raising=False)
    return ProcessGroup(comm_world().Dup(), TIMEOUT, hierarchical=mode)


def counting(group):
    """Count the calls that took the hierarchical path."""
    calls, start = [], group._hier.start

    def counted(*args):
        calls.append(args)
        return start(*args)
    group._hier.start = counted
    return calls


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fake", [1, 2])
def test_layout_follows_the_fake_nodes(monkeypatch, fake):
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    group = make_group(monkeypatch, fake, "1", by_env=False)
    try:
        nodes = [r * fake // size for r in range(size)]
        hier = group._hier
        assert (hier.node_index, hier.nodes) == (nodes[rank], len(set(nodes)))
        assert hier.local_size == nodes.count(nodes[rank])
        assert hier.local_rank == nodes[:rank].count(nodes[rank])
    finally:
        group.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("by_env", [False, True])
@pytest.mark.parametrize("fake", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_results_equal_the_flat_all_reduce(monkeypatch, fake, by_env, dtype, op):
    if op is ReduceOp.AVG and dtype is np.int32:
        pytest.skip("AVG needs floating point")
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    group = make_group(monkeypatch, fake, "1", by_env)
    flat = ProcessGroup(world.Dup(), TIMEOUT, hierarchical="0")
    try:
        calls = counting(group)
        values = [np.arange(6, dtype=dtype) % 4 + r + 1 for r in range(size)]
        expected = {ReduceOp.SUM: sum(values), ReduceOp.AVG: sum(values) / size,
                    ReduceOp.MIN: np.minimum.reduce(values), ReduceOp.MAX: np.maximum.reduce(values),
                    ReduceOp.PRODUCT: np.multiply.reduce(values)}[op].astype(dtype)
        blocking, pending = values[rank].copy(), values[rank].copy()
        reference = values[rank].copy()
        assert group.iallreduce(blocking, op, blocking=True) is None
        work = group.iallreduce(pending, op)
        work.wait()
        flat.iallreduce(reference, op, blocking=True)
        assert len(calls) == 2
        np.testing.assert_array_equal(blocking, expected)
        np.testing.assert_array_equal(pending, expected)
        np.testing.assert_array_equal(blocking, reference)
    finally:
        group.free()
        flat.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fake", [1, 2])
def test_pending_calls_waited_in_any_order(monkeypatch, fake):
    """Odd ranks wait newest first: each call must still post its stages in call order on every
    rank (a stage posted out of order would meet another call's, of another size)."""
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    group = make_group(monkeypatch, fake, "1", by_env=True)
    try:
        arrays = [np.full(n, rank + 1.0) for n in (3, 1000, 7, 50000, 2)]
        works = [group.iallreduce(a) for a in arrays]
        for work in (reversed(works) if rank % 2 else works):
            work.wait()
        total = size * (size + 1) / 2
        for a in arrays:
            np.testing.assert_array_equal(a, np.full(a.size, total))
        bools = np.array([rank == 0, False, True])
        group.iallreduce(bools, ReduceOp.SUM, blocking=True)  # any
        np.testing.assert_array_equal(bools, [True, False, True])
    finally:
        group.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fake", [1, 2])
def test_auto_takes_the_hierarchical_path_across_nodes_from_the_threshold(monkeypatch, fake):
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    monkeypatch.setenv(hierarchical.FAKE_PLACEMENT_ENV, "cyclic")  # block placement stays flat
    group = make_group(monkeypatch, fake, "auto", by_env=True, min_bytes=4096)
    try:
        spans = group._hier.nodes > 1 and not group._hier.blocked
        assert group._hier.use(4096) is spans and group._hier.use(4095) is False
        calls = counting(group)
        small, large = np.full(10, rank + 1.0), np.full(1024, rank + 1.0)  # 80 B, 8 KB
        group.iallreduce(small, blocking=True)
        group.iallreduce(large).wait()
        assert group.allreduce_now(small, ReduceOp.SUM) is False  # the general path decides
        assert len(calls) == (1 if spans else 0)
        total = size * (size + 1) / 2
        np.testing.assert_array_equal(small, np.full(10, total))
        np.testing.assert_array_equal(large, np.full(1024, total))
    finally:
        group.free()


@pytest.mark.mpi(min_size=1)
def test_info_shows_nodes_and_ranks_per_node(monkeypatch):
    """hpcgrad-info's report: the node count, this rank's node and its ranks per node."""
    world = comm_world()
    rank, size = world.Get_rank(), world.Get_size()
    monkeypatch.setenv(hierarchical.FAKE_NODES_ENV, "2")
    monkeypatch.setenv(hierarchical.MODE_ENV, "auto")
    reports = world.allgather(info.collect_info(world))
    nodes = [r * 2 // size for r in range(size)]
    assert [r["node"] for r in reports] == nodes
    assert [r["ranks_per_node"] for r in reports] == [nodes.count(n) for n in nodes]
    assert {r["nodes"] for r in reports} == {len(set(nodes))}
    assert reports[rank]["hierarchical_allreduce"].startswith("auto (across nodes, from 4194304")
    text = info.format_report(reports)
    assert "  nodes " in text and "HPCGRAD_FAKE_NODES=2" in text
    assert "ranks_per_node" in text  # shared, or per rank where nodes differ
    assert "  node  " in text.split("per rank:")[1].splitlines()[1]  # each rank's node
