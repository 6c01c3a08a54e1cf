"""Issue 26's DDP rows: a static graph that changes stops every rank before an unsynchronised
step (Note [Static graph] in hpcgrad/ddp/reducer.py), as launched 2-rank jobs; DDP's
communicator in the flight recorder under its own name (Note [DDP in the flight recorder] in
hpcgrad/ddp/data_parallel.py), run under mpiexec; a DDP built on one rank only speaks and ends
within the group's timeout (Note [DDP construction meets first]), launched."""

import sys
from pathlib import Path

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

mpi2 = pytest.mark.mpi(min_size=2)

SCRIPTS = Path(__file__).parents[1] / "scripts"
PYTORCH_UNUSED = ("This error indicates that your training graph has changed in this iteration, "
                  "e.g., one parameter is used in first iteration, but then got unused in the "
                  "second iteration. this is not compatible with static_graph set to True.")
PYTORCH_USED = ("Your training graph has changed in this iteration, e.g., one parameter is "
                "unused in first iteration, but then got used in the second iteration. this is "
                "not compatible with static_graph set to True.")


def run_static(launch, mode):
    # A timeout far beyond the job's own time: a rank left waiting would show as a timeout.
    job = launch([sys.executable, str(SCRIPTS / "ddp26_static_unused.py"), mode], nprocs=2,
                 env={"HPCGRAD_COMM_TIMEOUT": "60"}, timeout=90, mpiexec_timeout=80)
    assert not job.timed_out and job.returncode not in (0, None), job.output
    assert "timed out" not in job.output and "did not complete within" not in job.output, \
        job.output
    for rank in (0, 1):
        # The first step (the recorded graph) trains; the second raises from backward, before
        # its optimizer step, with every rank's weights and gradients still equal.
        assert f"[rank {rank}] step 0 done" in job.stdout, job.output
        assert f"[rank {rank}] step 1 done" not in job.stdout, job.output
        assert f"[rank {rank}] step 1 backward raised: DistributedDataParallel(static_graph=" \
               "True): the training graph changed in this iteration on rank" in job.stdout, \
            job.output
        assert f"[rank {rank}] weights agree: True" in job.stdout, job.output
        assert f"[rank {rank}] gradients agree: True" in job.stdout, job.output
    return job


def test_static_graph_parameter_unused_on_every_rank(launch):
    """Before: the second step ran on gradients of unreduced buckets (weights differed across
    ranks) and the third forward raised the generic unused-parameter error."""
    job = run_static(launch, "all")
    assert "the training graph changed in this iteration on ranks 0, 1 of 2" in job.stdout
    for rank in (0, 1):
        assert f"Parameters which did not receive grad for rank {rank}: side.weight, " \
               "side.bias" in job.stdout, job.output
    assert job.stdout.count(PYTORCH_UNUSED) == 2, job.output


def test_static_graph_parameter_unused_on_one_rank(launch):
    """Before: rank 1 raised at its third forward; rank 0 waited for rank 1's bucket until the
    group's timeout."""
    job = run_static(launch, "one")
    assert job.stdout.count("the training graph changed in this iteration on rank 1 of 2") \
        == 2, job.output
    assert "Parameters which did not receive grad for rank 1: side.weight, side.bias" \
        in job.stdout, job.output
    assert job.stdout.count(PYTORCH_UNUSED) == 1, job.output
    assert "Rank 0's own graph did not change: the error of rank 1 names the parameters" \
        in job.stdout, job.output


def test_static_graph_parameter_used_late_on_one_rank(launch):
    """Before: rank 1 raised from its hook; rank 0 waited for rank 1's bucket until the
    group's timeout."""
    job = run_static(launch, "late")
    assert job.stdout.count("the training graph changed in this iteration on rank 1 of 2") \
        == 2, job.output
    assert PYTORCH_USED in job.stdout, job.output
    assert "fired more often than in the first iteration for rank 1: side.weight, side.bias" \
        in job.stdout, job.output


# --- DDP's communicator in the flight recorder ------------------------------------------------
def recorded_ops(gid, since):
    return [e["op"] for e in RECORDER.entries() if e["group"] == gid and e["slot"] >= since]


def check_ddp_is_named(group, user_name):
    """A DDP step and a user all_reduce: DDP's all-reduces are recorded under "DDP(<the user's
    group>)", with an id every rank agrees on, the user's under the user's group."""
    since = RECORDER._next_slot()
    model = nn.Linear(3, 2).double()
    ddp = DDP(model, process_group=group)
    ddp(hg.tensor(np.ones((2, 3)))).sum().backward()
    user = np.ones(4)
    dist.all_reduce(user, group=group)
    mine = ddp.reducer.process_group._gid
    names = dict(enumerate(name for name, _ in RECORDER.groups()))
    assert names[group._gid] == user_name
    assert names[mine] == f"DDP({user_name})" and mine != group._gid
    assert RECORDER.groups()[mine][1] == group.ranks
    ddp_ops, user_ops = recorded_ops(mine, since), recorded_ops(group._gid, since)
    assert "allreduce" in ddp_ops and "broadcast" in ddp_ops, ddp_ops
    # The user's group saw its own all_reduce, none of DDP's broadcasts.
    assert "allreduce" in user_ops and "broadcast" not in user_ops, user_ops
    everyone = [None] * group.size()
    dist.all_gather_object(everyone, (mine, group._gid), group=group)
    assert everyone == [(mine, group._gid)] * group.size()  # ids agree across ranks


@mpi2
def test_ddp_collectives_recorded_as_ddp_default(world):
    check_ddp_is_named(world, "default")


@mpi2
def test_ddp_collectives_recorded_as_ddp_new_group(group):
    check_ddp_is_named(group, f"new_group({group.ranks})")


@pytest.mark.mpi(min_size=3)
def test_ddp_over_a_subgroup_keeps_the_user_group_id():
    """A DDP over a subgroup is built by its members only: registered there, it would shift
    later groups' ids on them alone, so it stays under the user's group's id; the ids of
    groups made later still agree on every rank."""
    dist.init_process_group()
    sub = dist.new_group([0, 1])
    if dist.get_rank() in (0, 1):
        ddp = DDP(nn.Linear(3, 2).double(), process_group=sub)
        assert ddp.reducer.process_group._gid == sub._gid
    later = dist.new_group()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (later._gid, len(RECORDER.groups())))
    assert len(set(everyone)) == 1, everyone
    dist.destroy_process_group(later)


# --- DDP construction meets first ---------------------------------------------------------------
def test_ddp_built_on_one_rank_speaks_and_ends_within_the_timeout(launch):
    """Rank 1 never constructs DDP (it sleeps 120 s). Before: rank 0 waited in MPI_Comm_idup,
    which nothing records, in silence until the group's timeout (30 minutes by default). Now
    the stall inspector reports rank 0's construction barrier at HPCGRAD_STALL_WARNING, and
    the group's timeout ends the job with an error naming DDP construction and rank 1."""
    script = SCRIPTS / "ddp_construct_on_one_rank.py"
    job = launch([sys.executable, str(script)], nprocs=2,
                 env={"HPCGRAD_COMM_TIMEOUT": "4", "HPCGRAD_STALL_WARNING": "1"},
                 timeout=60, mpiexec_timeout=40)
    assert job.returncode not in (0, None) and not job.timed_out, job.output
    assert job.elapsed < 30, f"took {job.elapsed:.1f} s (rank 1 sleeps 120 s):\n{job.output}"
    warning = [line for line in job.stderr.splitlines()
               if line.startswith("[hpcgrad stall inspector] barrier #")]
    assert warning and "on group default (world ranks 0, 1)" in warning[0] \
        and "not reached by rank 1" in warning[0], job.output
    assert ("[rank 0] hpcgrad.comm.work.CommTimeoutError: DistributedDataParallel "
            "construction on group default (world ranks 0, 1) did not complete within 4 s on "
            "rank 0: rank 1 did not come. Every rank of the group must construct DDP") \
        in job.stderr, job.output
    # The warning came before the error.
    assert job.stderr.index(warning[0]) < job.stderr.index("CommTimeoutError"), job.output


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
