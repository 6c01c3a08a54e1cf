"""Collectives on the default group: every op, dtype and call mode against a local reference."""

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.distributed import ReduceOp, api
from hpcgrad.tensor import Tensor

import dist_cases as cases

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("world")]

REDUCTIONS = {"all_reduce": cases.check_all_reduce, "reduce": cases.check_reduce,
              "reduce_scatter": cases.check_reduce_scatter,
              "reduce_scatter_tensor": cases.check_reduce_scatter_tensor}
MOVES = {"broadcast": cases.check_broadcast, "all_gather": cases.check_all_gather,
         "all_gather_into_tensor": cases.check_all_gather_into_tensor,
         "all_to_all": cases.check_all_to_all, "all_to_all_single": cases.check_all_to_all_single}


@pytest.mark.parametrize("dtype, op, i, j", cases.reduction_cases())
def test_reductions(dtype, op, i, j):
    """Each reduction on (dtype, op); the call mode rotates with dtype, op and collective."""
    for k, check in enumerate(REDUCTIONS.values()):
        check(dtype, op, cases.mode_for(i, j, k))


@pytest.mark.parametrize("dtype, i", [cases.dtype_param(d, i) for i, d in
                                      enumerate(cases.DTYPE_NAMES)])
def test_data_movement(dtype, i):
    """Each data-moving collective on dtype; the call mode rotates with dtype and collective."""
    for k, check in enumerate(MOVES.values()):
        check(dtype, cases.mode_for(i, k))


@pytest.mark.parametrize("mode", cases.MODES)
def test_all_gather_into_stacked_tensor(mode):
    cases.check_all_gather_into_tensor("float32", mode, stacked=True)


@pytest.mark.parametrize("mode", ["sync-array", "wait-array", "poll-array", "future-array"])
def test_barrier(mode):
    cases.check_barrier(mode)


def test_all_reduce_of_a_large_buffer():
    """Big enough for MPICH's pipelined algorithms (8 MB), through the polling wait."""
    x = np.full(1 << 21, dist.get_rank() + 1, np.float32)
    dist.all_reduce(x)
    n = dist.get_world_size()
    assert np.all(x == n * (n + 1) / 2)


def test_float16_and_bfloat16_stay_exact_past_their_precision():
    """4097 is not a float16: each rank's 1 sums to an exact world size, and so does the AVG."""
    for dtype in [np.float16] + ([cases.BFLOAT16] if cases.BFLOAT16 is not None else []):
        x = np.ones(5, dtype)
        dist.all_reduce(x)
        assert np.all(x.astype(np.float64) == dist.get_world_size())
        dist.all_reduce(x, ReduceOp.AVG)
        assert np.all(x.astype(np.float64) == dist.get_world_size())


def test_sequence_numbers_count_every_call(world):
    before = world._seq
    dist.all_reduce(np.zeros(2))
    work = dist.broadcast(np.zeros(2), 0, async_op=True)
    work.wait()
    assert world._seq == before + 2
    assert f"broadcast #{before + 2} (2 x float64, shape [2]) in a group of " in repr(work)


# --- errors: raised on every rank before anything is sent, so the test is collective-safe ------
def test_bad_op():
    with pytest.raises(TypeError, match=r"op must be a hpcgrad.distributed.ReduceOp .*got 'sum'"):
        dist.all_reduce(np.zeros(3), op="sum")


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_avg_needs_floats(name, dtype):
    with pytest.raises(ValueError, match=f"ReduceOp.AVG needs a floating-point tensor, got "
                                         f"{dtype}; use SUM and divide"):
        REDUCTIONS[name](dtype, ReduceOp.AVG, "sync-array")


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_numbers_have_no_min_or_max(op, dtype):
    """As PyTorch: complex numbers are not ordered (before: a raw MPI error from MPICH)."""
    for call in (lambda x: dist.all_reduce(x, op), lambda x: dist.all_reduce(x, op, async_op=True),
                 lambda x: dist.reduce(x, 0, op)):
        with pytest.raises(TypeError, match=rf"ReduceOp.{op.name} is not defined for complex "
                                            rf"tensors \({np.dtype(dtype)}\): complex numbers "
                                            r"are not ordered"):
            call(np.ones(3, dtype))


def test_unsupported_dtype():
    with pytest.raises(TypeError, match=r"dtype datetime64\[s\], which hpcgrad cannot send"):
        dist.all_reduce(np.zeros(3, "datetime64[s]"))


def test_rejects_lists_and_scalars():
    with pytest.raises(TypeError, match="expected an hpcgrad Tensor or a numpy/cupy array, "
                                        "got list"):
        dist.all_reduce([1.0, 2.0])


def test_non_contiguous():
    x = np.zeros((4, 6))[:, ::2]
    with pytest.raises(ValueError, match=r"tensor must be contiguous for MPI \(shape \[4, 3\], "
                                         r"strides \[48, 16\]\).*ascontiguousarray"):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        dist.broadcast(Tensor(x), 0)


def test_read_only():
    x = np.frombuffer(bytes(32))
    with pytest.raises(ValueError, match=r"tensor is read-only \(writeable=False, e.g. numpy."
                                         r"frombuffer over bytes\) and cannot receive data; pass "
                                         r"a writable copy, e.g. x.copy\(\)"):
        dist.all_reduce(x)
    n = dist.get_world_size()
    frozen = np.zeros(2 * n)
    frozen.flags.writeable = False
    for call in (lambda: dist.broadcast(Tensor(frozen), 0), lambda: dist.recv(frozen, 0),
                 lambda: dist.all_gather_into_tensor(frozen, np.zeros(2))):
        with pytest.raises(ValueError, match="is read-only"):
            call()


def test_read_only_input_is_fine_where_nothing_is_written():
    n = dist.get_world_size()
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    out = [np.zeros(3) for _ in range(n)]
    dist.all_gather(out, frozen)
    assert all(np.array_equal(o, frozen) for o in out)


def test_wrong_list_lengths():
    n = dist.get_world_size()
    x = np.zeros(3)
    with pytest.raises(ValueError, match=f"all_gather: tensor_list has {n + 1} entries, expected "
                                         f"one per rank \\({n}\\)"):
        dist.all_gather([np.zeros(3) for _ in range(n + 1)], x)
    with pytest.raises(ValueError, match=f"reduce_scatter: input_list has {n + 1} entries"):
        dist.reduce_scatter(x, [np.zeros(3) for _ in range(n + 1)])
    with pytest.raises(ValueError, match=f"all_to_all: expected {n} input and output tensors "
                                         f"\\(one per rank\\), got {n} and {n + 1}"):
        dist.all_to_all([np.zeros(3) for _ in range(n + 1)], [np.zeros(3) for _ in range(n)])
    with pytest.raises(ValueError, match=f"all_gather_object: object_list must have {n} entries"):
        dist.all_gather_object([None] * (n + 1), "x")


def test_wrong_shapes_and_dtypes():
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=r"all_gather: every entry of tensor_list must match the "
                                         r"input \(\[3\], float64\); got \[4\], float64"):
        dist.all_gather([np.zeros(4) for _ in range(n)], np.zeros(3))
    with pytest.raises(ValueError, match=r"all_gather: every entry .* got \[3\], float32"):
        dist.all_gather([np.zeros(3, np.float32) for _ in range(n)], np.zeros(3))
    with pytest.raises(ValueError, match=r"reduce_scatter: every entry of input_list must match "
                                         r"the output \(\[3\], float64\); got \[2\], float64"):
        dist.reduce_scatter(np.zeros(3), [np.zeros(2) for _ in range(n)])
    with pytest.raises(ValueError, match=rf"all_gather_into_tensor output has shape "
                                         rf"\[{n * 2 + 1}\]; expected {n} blocks of shape \[2\]"):
        dist.all_gather_into_tensor(np.zeros(n * 2 + 1), np.zeros(2))
    with pytest.raises(TypeError, match="all_gather output has dtype int64, expected the input's "
                                        "float64"):
        dist.all_gather_into_tensor(np.zeros(n * 2, np.int64), np.zeros(2))
    with pytest.raises(ValueError, match=rf"reduce_scatter_tensor input has shape \[{n * 2 + 1}\]"):
        dist.reduce_scatter_tensor(np.zeros(2), np.zeros(n * 2 + 1))
    if n > 1:  # one rank takes any length as one block
        with pytest.raises(ValueError, match=rf"all_to_all_single: dim 0 \({n * 2 + 1}\) must "
                                             rf"split into {n} equal blocks"):
            dist.all_to_all_single(np.zeros(n * 2 + 1), np.zeros(n * 2 + 1))
    with pytest.raises(TypeError, match=r"all_to_all: every input and output tensor must have one "
                                        r"dtype, got \['float32', 'float64'\]"):
        dist.all_to_all([np.zeros(2, np.float32) for _ in range(n)],
                        [np.zeros(2) for _ in range(n)])


def test_all_to_all_with_unequal_blocks_is_not_built():
    n = dist.get_world_size()
    if n == 1:
        pytest.skip("blocks of two shapes need two ranks")
    blocks = [np.zeros(k + 1) for k in range(n)]
    with pytest.raises(NotImplementedError, match="all_to_all with blocks of different shapes is "
                                                  "not built yet .*MPI_Ialltoallv"):
        dist.all_to_all([b.copy() for b in blocks], blocks)


def test_src_and_dst_must_be_world_ranks():
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"src={n} is not a member of this group \(world ranks "
                                         rf"\[{', '.join(map(str, range(n)))}\]\)"):
        dist.broadcast(np.zeros(2), n)
    with pytest.raises(ValueError, match=r"dst=-1 is not a member of this group"):
        dist.reduce(np.zeros(2), -1)


def test_uninitialized_default_group(monkeypatch):
    monkeypatch.setattr(api, "_default_group", None)
    assert not dist.is_initialized()
    for call in (lambda: dist.all_reduce(np.zeros(2)), dist.get_rank, dist.barrier,
                 lambda: dist.new_group([0])):
        with pytest.raises(RuntimeError, match=r"Default process group has not been initialized, "
                                               r"please make sure to call hpcgrad.distributed."
                                               r"init_process_group\(\)"):
            call()


def test_unknown_backend():
    """gloo and nccl run over MPI now (issue 26, tests/collectives/test_startup_issue26.py);
    a name PyTorch does not know is refused with the list."""
    with pytest.raises(ValueError, match=r"Invalid backend: 'ucc'; hpcgrad runs every backend "
                                         r"over MPI and accepts 'mpi', 'gloo', 'nccl' \(or None\)"):
        dist.init_process_group("ucc")


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("level", ["INFO", "DETAIL"])
def test_debug_checks_after_point_to_point_between_two_ranks(monkeypatch, level):
    """Sends and receives are numbered apart from collectives, so ranks that took no part in
    them still agree on the next collective's call number (before: DETAIL raised
    CollectiveMismatchError, '"seq": 2' against '"seq": 1')."""
    from hpcgrad.comm.mpi import MPI
    from hpcgrad.comm.process_group import ProcessGroup

    monkeypatch.setenv("HPCGRAD_DISTRIBUTED_DEBUG", level)
    group = ProcessGroup(MPI.COMM_WORLD.Dup(), 30)
    try:
        rank = group.rank()
        if rank == 0:
            group.isend(np.ones(2), 1).wait()
        elif rank == 1:
            group.irecv(np.zeros(2), 0).wait()
        x = np.ones(2)
        group.iallreduce(x, ReduceOp.SUM, None, True)
        assert x.tolist() == [group.size()] * 2
    finally:
        group.free()
