"""torch.distributed's functions on hpcgrad Tensors or numpy/cupy arrays, over the default group.

Ranks given as ``src``/``dst`` are world ranks, whatever the group, as in PyTorch.
"""

import datetime
import math
import numbers
import os
import pickle
import sys

import numpy as np
from mpi4py import MPI

from hpcgrad.base import backend, config
from hpcgrad.comm import stall, threads
from hpcgrad.comm.buffers import is_array
from hpcgrad.comm.flight_recorder import RECORDER, agree_job_id, install_signal_handler
from hpcgrad.comm.mpi import comm_world
from hpcgrad.comm.rendezvous import rendezvous
from hpcgrad.comm.process_group import ProcessGroup, ReduceOp
from hpcgrad.comm.progress import start_from_env
from hpcgrad.comm.work import CommTimeoutError, default_timeout
from hpcgrad.tensor.sparse import SparseCOOTensor
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.collectives.sparse_reduce import SparseAllReduceWork

_default_group = None
_local = None  # (local rank, local size) from the shared-memory split

# Note [torchrun's variables]
# Scripts written for torchrun read RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the
# environment (``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``); under mpiexec or srun
# they are absent and such a script died with KeyError. So importing hpcgrad.distributed sets
# them where they are absent, from MPI (rank, size) and the launcher's own variables for the
# node-local ones (MPICH's MPI_LOCALRANKID/MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_*,
# SLURM's SLURM_LOCALID), with no collective; init_process_group fills the local ones from
# its shared-memory split where no launcher said. A value already set is never changed,
# unless an hpcgrad process set it and this process inherited it (a test or a workflow that
# imported hpcgrad.distributed, then started mpiexec): HPCGRAD_TORCHRUN_ENV_PID names the
# process that set them, and another process sets them afresh.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_SETTER = "HPCGRAD_TORCHRUN_ENV_PID"
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _export_torchrun_env(rank, size, local=None):
    """Note [torchrun's variables]: set what is absent; ``local``: (local rank, local size)."""
    env = os.environ
    me = str(os.getpid())
    if (config.raw(_SETTER) or me) != me:  # inherited from the hpcgrad process that started us
        for name in _TORCHRUN_VARS:
            env.pop(name, None)
    env[_SETTER] = me
    env.setdefault("RANK", str(rank))
    env.setdefault("WORLD_SIZE", str(size))
    # torchrun's rendezvous address: scripts read it (os.environ["MASTER_ADDR"]) to pass it on;
    # MPI's launcher did the rendezvous here, so these are placeholders that nothing uses.
    env.setdefault("MASTER_ADDR", "localhost")
    env.setdefault("MASTER_PORT", "29500")
    if local is None and size == 1:
        local = (0, 1)
    if local is None:
        found_rank = next((env[v] for v in _LOCAL_RANK_VARS if env.get(v, "").isdigit()), None)
        found_size = next((env[v] for v in _LOCAL_SIZE_VARS if env.get(v, "").isdigit()), None)
        if found_rank is not None:
            env.setdefault("LOCAL_RANK", found_rank)
        if found_size is not None:
            env.setdefault("LOCAL_WORLD_SIZE", found_size)
        return
    env.setdefault("LOCAL_RANK", str(local[0]))
    env.setdefault("LOCAL_WORLD_SIZE", str(local[1]))


_export_torchrun_env(comm_world().Get_rank(), comm_world().Get_size())


class _NonMember:
    """What ``new_group`` returns on ranks outside the group: using it is an error."""

    ranks = ()

    def __getattr__(self, name):
        raise RuntimeError(f"this rank is not a member of the group (called {name}); only the "
                           "ranks passed to new_group() may use it")


NON_GROUP_MEMBER = _NonMember()


def as_array(x):
    """The array behind an hpcgrad Tensor, or the numpy/cupy array itself (what comm/ sends)."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, Tensor):
        return x.array
    if is_array(x):
        return x
    raise TypeError(f"expected an hpcgrad Tensor or a numpy/cupy array, got {type(x).__name__}")


def _seconds(timeout, what="timeout"):
    """Seconds from a number or timedelta (None: HPCGRAD_COMM_TIMEOUT's); 0 means no limit."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{what} must be a number of seconds or a datetime.timedelta, got "
                        f"{type(timeout).__name__} {timeout!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0 (0: no limit), got "
                         f"{timeout!r}")
    return seconds


_BACKENDS = ("mpi", "gloo", "nccl")  # PyTorch's names; every one runs over MPI here


def _mpi_backend(backend):
    """None for ``backend=None`` or 'mpi', else the name of the PyTorch backend mapped to MPI
    ('gloo', 'nccl', 'cpu:gloo,cuda:nccl', any case); a clear error for anything else."""
    if backend is None:
        return None
    name = str(backend).lower()
    parts = [part.split(":")[-1].strip() for part in name.split(",")]
    if not isinstance(backend, str) or not all(part in _BACKENDS for part in parts):
        raise ValueError(f"Invalid backend: {backend!r}; hpcgrad runs every backend over MPI "
                         f"and accepts {', '.join(map(repr, _BACKENDS))} (or None)")
    return None if set(parts) == {"mpi"} else name


def _group_shape(world_size, rank, size, me):
    """(world_size, rank) of the default group this MPI rank joins, checked against MPI's:
    Note [A default group of fewer ranks]."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if value is not None and (not isinstance(value, numbers.Integral)
                                  or isinstance(value, bool)):
            raise TypeError(f"init_process_group: {name} must be an int, got "
                            f"{type(value).__name__} {value!r}")
    want = size if world_size is None or world_size == -1 else int(world_size)
    if not 1 <= want <= size:
        raise ValueError(f"init_process_group: world_size={want} but the MPI job has {size} "
                         f"rank{'s' if size > 1 else ''}; launch at least {want} ranks "
                         f"(mpiexec -n {max(want, 1)}), or pass world_size from 1 to {size} "
                         f"(leave it out for all {size})")
    if rank is not None and rank != -1 and rank != me:
        raise ValueError(f"init_process_group: rank={rank} but this process is MPI rank {me}; "
                         f"under MPI the default group's rank r is MPI rank r (the group of "
                         f"world_size={want} is MPI ranks 0-{want - 1}): leave rank out or pass "
                         f"rank={me}")
    if me >= want:
        raise ValueError(f"init_process_group: this process is MPI rank {me}, outside "
                         f"world_size={want}: the default group of world_size={want} is MPI "
                         f"ranks 0-{want - 1}; call init_process_group only there (the other "
                         f"ranks may call init_rpc alone), or launch so that the group's ranks "
                         f"are the lowest MPI ranks")
    return want, me


# Note [A default group of fewer ranks]
#     PyTorch lets some processes form the default group while others only join RPC
#     (examples/distributed/rpc/ddp_rpc: ranks 0-1 call init_process_group(world_size=2,
#     rank=r), all four call init_rpc(world_size=4)). Here the default group of world_size W
#     is MPI ranks 0..W-1, its rank r MPI rank r; a rank passed that is not MPI's, a W larger
#     than MPI's or ranks disagreeing on W are errors that say so. The group meets in a
#     rendezvous of its members alone (Note [Start-ups never match each other] in
#     comm/rendezvous.py) and is built with MPI_Comm_create_group, collective over the group
#     only; its node split and stall inspector run on it, so the other ranks take no part.
def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Start the default group (idempotent; the MPI is already running).

    ``world_size`` and ``rank`` (PyTorch's; -1 or None: MPI's): the default group of
    world_size W is MPI ranks 0..W-1 and its rank r is MPI rank r, so only those ranks call
    this (the others may use RPC alone: Note [A default group of fewer ranks]); a W larger
    than MPI's, a rank that is not MPI's, or ranks passing different W are clear errors.
    ``backend``: 'gloo', 'nccl' and 'mpi' (or None) all run over MPI (rank 0 says so once for
    the first two); anything else is an error. ``init_method``, ``store``, ``group_name``,
    ``pg_options`` and ``device_id`` are accepted and ignored: mpiexec/srun placed the ranks.

    ``timeout`` (seconds or timedelta; default env HPCGRAD_COMM_TIMEOUT or 30 min; 0: none)
    bounds every wait: ``Work.wait()`` raises CommTimeoutError, and a blocking collective that
    overruns it is reported and aborts the job (Note [Blocking calls] in comm/work.py). It
    bounds this call too: if some rank of the group has not called init_process_group within
    ``timeout``, rank 0 prints which ranks are missing and the job ends (MPI_Abort; Note
    [Bounded start-up] in comm/rendezvous.py), as PyTorch's rendezvous times out; meanwhile,
    every HPCGRAD_STALL_WARNING seconds, rank 0 prints which ranks have not arrived yet.
    HPCGRAD_PROGRESS_THREAD=1 also starts the progress thread (Note [Communication progress]
    in comm/progress.py); unset (auto), DistributedDataParallel starts it when its group spans
    nodes (Note [Progress across nodes]); 0 never.
    """
    global _default_group, _local
    mapped = _mpi_backend(backend)
    seconds = _seconds(timeout, "init_process_group: timeout")
    if _default_group is None:
        world = comm_world()
        size, me = _group_shape(world_size, rank, world.Get_size(), world.Get_rank())
        rendezvous(world, seconds, "init_process_group",
                   f"every rank must call init_process_group() (MPI ranks 0-{size - 1}, the "
                   f"group of world_size={size}); check the missing ranks' output (an error, "
                   f"an exit or a long step before it), or give it more time: "
                   f"init_process_group(timeout=...) or HPCGRAD_COMM_TIMEOUT",
                   members=range(size), value=size, value_name="world_size")
        if size == world.Get_size():
            comm = world.Dup()
        else:  # collective over the group only: Note [A default group of fewer ranks]
            everyone = world.Get_group()
            members = everyone.Range_incl([(0, size - 1, 1)])
            comm = world.Create_group(members, tag=_CREATE_GROUP_TAG)
            members.Free()
            everyone.Free()
        if mapped is not None and me == 0:
            print(f"hpcgrad: backend={mapped!r} runs over MPI (hpcgrad's one transport; "
                  f"collectives, devices and timeouts as documented for 'mpi')",
                  file=sys.stderr, flush=True)
        _default_group = ProcessGroup(comm, seconds, name="default")
        agree_job_id(comm)  # every flight record names this job (Note [Job ids])
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        _local = (node.Get_rank(), node.Get_size())
        node.Free()
        threads.share_cores(_local[1])  # Note [Threads per rank]
        _export_torchrun_env(world.Get_rank(), world.Get_size(), _local)
        start_from_env()
        # Failure knowledge by default (Note [Flight recorder], Note [Stall inspector]):
        # SIGUSR2 dumps this rank's record; rank 0 names the ranks a stalled call waits for.
        install_signal_handler()
        stall.start(comm)
    return _default_group


_CREATE_GROUP_TAG = 2601  # MPI_Comm_create_group's; only the group's ranks take part


def is_initialized():
    return _default_group is not None


def destroy_process_group(group=None):
    """Free ``group``'s communicator, or with no argument the default group's (init may follow)."""
    global _default_group, _local
    if group is None:
        if _default_group is None:
            return
        group, _default_group, _local = _default_group, None, None
        stall.stop()  # local; init_process_group starts it again (collectively)
    if group is NON_GROUP_MEMBER:
        return
    group.free()


def _group(group):
    if group is None:
        if _default_group is None:
            raise RuntimeError("Default process group has not been initialized, please make sure "
                               "to call hpcgrad.distributed.init_process_group()")
        return _default_group
    if group is NON_GROUP_MEMBER:
        raise RuntimeError(f"world rank {_default_group.rank()} is not a member of this group "
                           "(new_group() returned NON_GROUP_MEMBER here); only the ranks passed "
                           "to new_group() may use it")
    return group


def get_rank(group=None):
    return -1 if group is NON_GROUP_MEMBER else _group(group).rank()


def get_world_size(group=None):
    return -1 if group is NON_GROUP_MEMBER else _group(group).size()


def get_backend(group=None):
    """The backend of ``group`` (default: the default group), as torch.distributed names it:
    always 'mpi', since 'gloo' and 'nccl' run over MPI here (init_process_group says so)."""
    if group is NON_GROUP_MEMBER:
        raise ValueError("Invalid process group specified: this rank is not a member of it")
    _group(group)
    return "mpi"


def get_default_backend_for_device(device):
    """PyTorch's default backend name for ``device`` ('gloo' for the CPU, 'nccl' for CUDA);
    init_process_group runs either over MPI."""
    kind = str(device).partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"Default backend not registered for device : {device}")
    return "gloo" if kind == "cpu" else "nccl"


def get_local_rank():
    """Rank among the ranks of this node (shared-memory split)."""
    _group(None)
    return _local[0]


def get_local_size():
    _group(None)
    return _local[1]


def new_group(ranks=None, timeout=None):
    """A group of the given world ranks. Every rank of the default group must call it, also
    the ranks outside ``ranks``, within the default group's timeout (else CommTimeoutError,
    and the default group is unusable). ``timeout``: the new group's (default: the default
    group's)."""
    world = _group(None)
    members = sorted(set(range(world.size()) if ranks is None else ranks))
    for r in members:
        if not 0 <= r < world.size():
            raise ValueError(f"new_group: rank {r} is not in the world (size {world.size()})")
    timeout = world.timeout if timeout is None else _seconds(timeout, "new_group: timeout")
    me = world.rank()
    try:  # every rank is here before the blocking Split (Note [Bounded start-up])
        world.ibarrier().wait()
    except CommTimeoutError:
        raise CommTimeoutError(f"new_group(ranks={members}): not every rank of the default "
                               f"group called new_group within {world.timeout:g} s; every rank "
                               f"must call it, also the ranks outside the group (the default "
                               f"group is unusable now)") from None
    # Every rank registers the group, members or not, so recorder ids agree across ranks.
    gid = RECORDER.register_group(members, f"new_group({members})")
    comm = world.comm.Split(0 if me in members else MPI.UNDEFINED, me)
    if comm == MPI.COMM_NULL:
        return NON_GROUP_MEMBER
    return ProcessGroup(comm, timeout, members, recorder_id=gid)


def _group_rank(group, world_rank, what):
    if world_rank not in group.ranks:
        raise ValueError(f"{what}={world_rank} is not a member of this group (world ranks "
                         f"{group.ranks})")
    return group.ranks.index(world_rank)


# --- collectives --------------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group, in place on every rank. All ranks call it. A
    row-sparse tensor (SparseCOOTensor) is summed by gathering every rank's rows, as PyTorch's
    gloo backend does for sparse tensors."""
    g = _group(group)
    if isinstance(tensor, SparseCOOTensor):
        if op is not ReduceOp.SUM:
            raise RuntimeError(f"all_reduce of a sparse tensor: only ReduceOp.SUM is supported "
                               f"(got {op}); sum, then scale, or use to_dense()")
        work = SparseAllReduceWork(g, tensor)
        if not async_op:
            work.wait()
            return None
        return work
    if not async_op and g.allreduce_now(tensor.array if type(tensor) is Tensor else tensor, op):
        return None
    return g.iallreduce(as_array(tensor), op, [tensor], not async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """Every rank's ``tensor`` becomes rank ``src``'s. All ranks call it."""
    g = _group(group)
    return g.ibroadcast(as_array(tensor), _group_rank(g, src, "src"), result=[tensor],
                        blocking=not async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce into rank ``dst``'s ``tensor`` in place. All ranks call it."""
    g = _group(group)
    return g.ireduce(as_array(tensor), _group_rank(g, dst, "dst"), op, result=[tensor],
                     blocking=not async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """``tensor_list[r]`` receives rank r's ``tensor``. All ranks call it, same shapes."""
    g = _group(group)
    array = as_array(tensor)
    if len(tensor_list) != g.size():
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} entries, expected one "
                         f"per rank ({g.size()})")
    targets = [as_array(t) for t in tensor_list]
    for t in targets:
        if t.shape != array.shape or t.dtype != array.dtype:
            raise ValueError(f"all_gather: every entry of tensor_list must match the input "
                             f"({list(array.shape)}, {array.dtype}); got {list(t.shape)}, "
                             f"{t.dtype}")
    gathered = _empty(array, (g.size(),) + array.shape)
    return g.iallgather(gathered, array, result=tensor_list,
                        after=_copy_blocks(gathered, targets), blocking=not async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Rank r's input fills block r of ``output_tensor`` (shape (size*n, ...) or (size, n, ...))."""
    g = _group(group)
    array, output = as_array(input_tensor), as_array(output_tensor)
    view = _blocks(output, g.size(), array.shape, "all_gather_into_tensor output")
    return g.iallgather(view, array, result=[output_tensor], blocking=not async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_list`` elementwise across ranks; rank r gets the r-th entry's result."""
    g = _group(group)
    out = as_array(output)
    if len(input_list) != g.size():
        raise ValueError(f"reduce_scatter: input_list has {len(input_list)} entries, expected "
                         f"one per rank ({g.size()})")
    inputs = [as_array(t) for t in input_list]
    for t in inputs:
        if t.shape != out.shape or t.dtype != out.dtype:
            raise ValueError(f"reduce_scatter: every entry of input_list must match the output "
                             f"({list(out.shape)}, {out.dtype}); got {list(t.shape)}, {t.dtype}")
    stacked = backend.get_array_module(out).stack(inputs)
    return g.ireduce_scatter(out, stacked, op, result=[output], blocking=not async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` (size blocks) across ranks; rank r's ``output`` gets block r."""
    g = _group(group)
    out = as_array(output)
    view = _blocks(as_array(input), g.size(), out.shape, "reduce_scatter_tensor input")
    return g.ireduce_scatter(out, view, op, result=[output], blocking=not async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """``input_tensor_list[r]`` goes to rank r, arriving in its ``output_tensor_list[me]``."""
    g = _group(group)
    inputs = [as_array(t) for t in input_tensor_list]
    outputs = [as_array(t) for t in output_tensor_list]
    if len(inputs) != g.size() or len(outputs) != g.size():
        raise ValueError(f"all_to_all: expected {g.size()} input and output tensors (one per "
                         f"rank), got {len(inputs)} and {len(outputs)}")
    if len({a.dtype for a in inputs + outputs}) != 1:
        raise TypeError(f"all_to_all: every input and output tensor must have one dtype, got "
                        f"{sorted({str(a.dtype) for a in inputs + outputs})}")
    if len({a.shape for a in inputs + outputs}) != 1:
        raise NotImplementedError("all_to_all with blocks of different shapes is not "
                                  "built yet (it needs MPI_Ialltoallv); pad to one shape")
    xp = backend.get_array_module(inputs[0])
    send = xp.stack(inputs)
    recv = xp.empty_like(send)
    return g.ialltoall(recv, send, result=output_tensor_list, after=_copy_blocks(recv, outputs),
                       blocking=not async_op)


def all_to_all_single(output, input, group=None, async_op=False):
    """Block r (along dim 0) of ``input`` goes to rank r; equal blocks only."""
    g = _group(group)
    array, out = as_array(input), as_array(output)
    if array.shape[0] % g.size():
        raise ValueError(f"all_to_all_single: dim 0 ({array.shape[0]}) must split into "
                         f"{g.size()} equal blocks")
    shape = (g.size(), array.shape[0] // g.size()) + array.shape[1:]
    return g.ialltoall(_blocks(out, g.size(), shape[1:], "all_to_all_single output"),
                       array.reshape(shape), result=[output], blocking=not async_op)


def barrier(group=None, async_op=False):
    """Wait until every rank of the group has called barrier."""
    return _group(group).ibarrier(blocking=not async_op)


# --- point to point ------------------------------------------------------------------------
def isend(tensor, dst, group=None, tag=0):
    g = _group(group)
    return g.isend(as_array(tensor), _group_rank(g, dst, "dst"), tag, result=[tensor])


def irecv(tensor, src=None, group=None, tag=None):
    """Receive into ``tensor``; the Work's ``result()`` is the sender's world rank."""
    g = _group(group)
    work = g.irecv(as_array(tensor), None if src is None else _group_rank(g, src, "src"), tag)
    work._result = g.ranks[work._result]
    return work


def send(tensor, dst, group=None, tag=0):
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src=None, group=None, tag=None):
    """Blocking receive; returns the sender's world rank."""
    return irecv(tensor, src, group, tag).result()


# --- Python objects (pickled; for small metadata, not for arrays) ----------------------------
# They travel as uint8 arrays through the group's own collectives, so they are numbered, checked
# under HPCGRAD_DISTRIBUTED_DEBUG=DETAIL and bounded by the group's timeout like any other call.
def broadcast_object_list(object_list, src=0, group=None):
    """Replace ``object_list``'s items on every rank with rank ``src``'s. All ranks call it."""
    g = _group(group)
    root = _group_rank(g, src, "src")
    payload = _pickled(list(object_list)) if g.rank() == root else None
    length = np.array([0 if payload is None else payload.size], np.int64)
    g.ibroadcast(length, root).wait()
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    g.ibroadcast(payload, root).wait()
    if g.rank() != root:
        object_list[:] = pickle.loads(payload.tobytes())


def all_gather_object(object_list, obj, group=None):
    """``object_list`` becomes every rank's ``obj``, in rank order. All ranks call it."""
    g = _group(group)
    if len(object_list) != g.size():
        raise ValueError(f"all_gather_object: object_list must have {g.size()} entries (one per "
                         f"rank), got {len(object_list)}")
    mine = _pickled(obj)
    lengths = np.empty(g.size(), np.int64)
    g.iallgather(lengths, np.array(mine.size, np.int64)).wait()
    padded = np.zeros(int(lengths.max()), np.uint8)  # equal blocks: no Allgatherv needed
    padded[:mine.size] = mine
    rows = np.empty((g.size(), padded.size), np.uint8)
    g.iallgather(rows, padded).wait()
    object_list[:] = [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, lengths)]


def _pickled(obj):
    return np.frombuffer(bytearray(pickle.dumps(obj)), np.uint8)


# --- helpers -----------------------------------------------------------------------------------
def _empty(array, shape):
    return backend.get_array_module(array).empty(shape, dtype=array.dtype)


def _copy_blocks(blocks, targets):
    """A finish step: block r of ``blocks`` into ``targets[r]`` once the operation completes."""
    def finish():
        for target, block in zip(targets, blocks):
            target[...] = block
    return finish


def _blocks(array, size, block_shape, what):
    """``array`` viewed as (size, *block_shape), without copying; clear error otherwise."""
    want = (size,) + tuple(block_shape)
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous (a reshaped copy would not receive the data)")
    if int(np.prod(want)) != array.size:
        raise ValueError(f"{what} has shape {list(array.shape)}; expected {size} blocks of "
                         f"shape {list(block_shape)}")
    return array.reshape(want)
