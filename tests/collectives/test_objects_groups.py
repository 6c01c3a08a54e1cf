"""Object collectives; sub-groups from new_group: members, non-members, src/dst as world ranks."""

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.distributed import ReduceOp

import dist_cases as cases

pytestmark = pytest.mark.usefixtures("world")


def objects_of(rank):
    """Objects of several kinds and sizes (the pickles differ in length from rank to rank)."""
    return [{"rank": rank, "name": "r" * (rank * 50)}, None, (rank, [1.5, "x"]),
            np.arange(rank + 2), "é" * rank]


def assert_same_objects(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, np.ndarray):
            np.testing.assert_array_equal(g, w)
        else:
            assert g == w


def check_broadcast_object_list(src, group=None):
    me = dist.get_rank()
    objects = objects_of(me) if me == src else [None] * len(objects_of(src))
    assert dist.broadcast_object_list(objects, src=src, group=group) is None
    assert_same_objects(objects, objects_of(src))


def check_all_gather_object(group=None):
    ranks = cases.members(group)
    out = [None] * len(ranks)
    dist.all_gather_object(out, objects_of(dist.get_rank()), group=group)
    for r, got in zip(ranks, out):
        assert_same_objects(got, objects_of(r))


@pytest.mark.mpi
@pytest.mark.parametrize("src", ["first", "last"])
def test_broadcast_object_list(src):
    check_broadcast_object_list(0 if src == "first" else dist.get_world_size() - 1)


@pytest.mark.mpi
def test_all_gather_object():
    check_all_gather_object()


@pytest.mark.mpi
def test_object_collectives_are_numbered_like_the_others(world):
    before = world._seq
    check_all_gather_object()
    check_broadcast_object_list(0)
    assert world._seq == before + 4  # sizes, then payloads


# --- sub-groups ---------------------------------------------------------------------------------
GROUP_CHECKS = {
    "all_reduce-SUM": lambda g: cases.check_all_reduce("float32", ReduceOp.SUM, "sync-tensor", g),
    "all_reduce-AVG": lambda g: cases.check_all_reduce("float64", ReduceOp.AVG, "wait-tensor", g),
    "all_reduce-MAX-int": lambda g: cases.check_all_reduce("int32", ReduceOp.MAX, "future-tensor",
                                                           g),
    "reduce": lambda g: cases.check_reduce("float16", ReduceOp.PRODUCT, "poll-array", g),
    "reduce_scatter": lambda g: cases.check_reduce_scatter("int64", ReduceOp.MIN, "sync-array", g),
    "reduce_scatter_tensor": lambda g: cases.check_reduce_scatter_tensor(
        "float32", ReduceOp.SUM, "wait-tensor", g),
    "broadcast": lambda g: cases.check_broadcast("float64", "future-tensor", g),
    "all_gather": lambda g: cases.check_all_gather("bool", "sync-tensor", g),
    "all_gather_into_tensor": lambda g: cases.check_all_gather_into_tensor("int32", "poll-array",
                                                                           g),
    "all_to_all": lambda g: cases.check_all_to_all("float32", "wait-tensor", g),
    "all_to_all_single": lambda g: cases.check_all_to_all_single("float64", "sync-array", g),
    "barrier": lambda g: cases.check_barrier("wait-array", g),
    "broadcast_object_list": lambda g: check_broadcast_object_list(g.ranks[-1], g),
    "all_gather_object": lambda g: check_all_gather_object(g),
}

# Group shapes at every size >= 2: the ranks after 0 (group ranks differ from world ranks), and
# the first and last (a gap in the middle from size 3 on).
LAYOUTS = {"tail": lambda n: list(range(1, n)), "ends": lambda n: [n - 1, 0]}


@pytest.fixture(params=LAYOUTS)
def sub_group(request):
    """(group or NON_GROUP_MEMBER, its world ranks); every rank creates it, all free it."""
    ranks = sorted(LAYOUTS[request.param](dist.get_world_size()))
    group = dist.new_group(LAYOUTS[request.param](dist.get_world_size()))
    yield group, ranks
    dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", GROUP_CHECKS)
def test_sub_group_collective(sub_group, name):
    group, ranks = sub_group
    if dist.get_rank() not in ranks:
        assert group is dist.NON_GROUP_MEMBER
        return
    assert group.ranks == ranks
    assert dist.get_rank(group) == ranks.index(dist.get_rank())
    assert dist.get_world_size(group) == len(ranks)
    GROUP_CHECKS[name](group)


@pytest.mark.mpi(min_size=2)
def test_non_member_error(sub_group):
    group, ranks = sub_group
    if dist.get_rank() in ranks:
        return
    assert dist.get_rank(group) == -1 and dist.get_world_size(group) == -1
    message = (rf"world rank {dist.get_rank()} is not a member of this group \(new_group\(\) "
               r"returned NON_GROUP_MEMBER here\); only the ranks passed to new_group\(\) "
               r"may use it")
    for call in (lambda: dist.all_reduce(np.zeros(2), group=group),
                 lambda: dist.broadcast(np.zeros(2), ranks[0], group=group),
                 lambda: dist.barrier(group=group),
                 lambda: dist.all_gather_object([None] * len(ranks), 1, group=group)):
        with pytest.raises(RuntimeError, match=message):
            call()
    with pytest.raises(RuntimeError, match="not a member of the group"):
        group.iallreduce(np.zeros(2))


@pytest.mark.mpi(min_size=2)
def test_src_not_in_group(sub_group):
    group, ranks = sub_group
    outsiders = [r for r in range(dist.get_world_size()) if r not in ranks]
    if not outsiders:
        pytest.skip("this group holds every rank")
    if dist.get_rank() not in ranks:
        return
    outsider = outsiders[0]
    listed = ", ".join(map(str, ranks))
    with pytest.raises(ValueError, match=rf"src={outsider} is not a member of this group "
                                         rf"\(world ranks \[{listed}\]\)"):
        dist.broadcast(np.zeros(2), outsider, group=group)
    with pytest.raises(ValueError, match=rf"dst={outsider} is not a member"):
        dist.reduce(np.zeros(2), outsider, group=group)
    with pytest.raises(ValueError, match=rf"src={outsider} is not a member"):
        dist.broadcast_object_list([None], src=outsider, group=group)


@pytest.mark.mpi
def test_new_group_of_everyone_and_of_one():
    everyone = dist.new_group()
    alone = dist.new_group([0])
    try:
        assert everyone.ranks == list(range(dist.get_world_size()))
        cases.check_all_reduce("float32", ReduceOp.SUM, "sync-array", everyone)
        if dist.get_rank() == 0:
            assert alone.size() == 1
            cases.check_all_reduce("float32", ReduceOp.SUM, "sync-array", alone)
        else:
            assert alone is dist.NON_GROUP_MEMBER
    finally:
        dist.destroy_process_group(everyone)
        dist.destroy_process_group(alone)


@pytest.mark.mpi
def test_new_group_with_a_rank_outside_the_world():
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"new_group: rank {size} is not in the world "
                                         rf"\(size {size}\)"):
        dist.new_group([0, size])


@pytest.mark.mpi
def test_local_rank_and_size():
    # mpiexec on one machine: the node is the world
    assert dist.get_local_rank() == dist.get_rank()
    assert dist.get_local_size() == dist.get_world_size()
