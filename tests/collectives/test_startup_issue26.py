"""PyTorch's start-up semantics over MPI (Note [A default group of fewer ranks] in
distributed/api.py, Note [Start-ups never match each other] and Note [Start-up speaks while it
waits] in comm/rendezvous.py), on launched jobs (tests/scripts/startup_modes.py)."""

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import hpcgrad.distributed as dist

SCRIPT = Path(__file__).parents[1] / "scripts" / "startup_modes.py"
BOUND = 60  # seconds: a job that hangs is killed and fails the test (they end in a few seconds)
MAPPED = "runs over MPI (hpcgrad's one transport"


def run(launch, mode, nprocs, env=None):
    job = launch([sys.executable, str(SCRIPT), mode], nprocs=nprocs, timeout=BOUND,
                 env={"HPCGRAD_COMM_TIMEOUT": "20", **(env or {})})
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    return job


def test_ddp_rpc_pattern(launch):
    """PyTorch's ddp_rpc example in small: ranks 0-1 form the default group (backend="gloo",
    world_size=2, rank=r), all four join RPC. Before: refused 'gloo'; with the backend left
    out, all four ranks hung with no message (the two start-ups matched each other)."""
    job = run(launch, "ddp_rpc", 4)
    assert job.returncode == 0, job.output
    grads = {}
    # (mpiexec may join two ranks' lines: match the words, not the lines)
    for trainer, group_size, weight, bias in re.findall(
            r"trainer (\d) of (\d): weight grad (\[\[.*?\]\]) bias grad (\[.*?\])", job.stdout):
        assert group_size == "2", job.output  # the trainers' default group has 2 ranks
        grads[int(trainer)] = np.array(ast.literal_eval(weight)), np.array(ast.literal_eval(bias))
    assert sorted(grads) == [0, 1], job.output
    # by hand: loss = sum(x W^T + b) over a 4x3 batch x_t = arange(12).reshape(4, 3) * (t + 1),
    # so dW[j] = column sums of x_t = (18, 22, 26) * (t + 1), averaged over t = 0, 1; db = 4
    expected = np.tile(np.array([18.0, 22.0, 26.0]) * 1.5, (2, 1))
    for weight, bias in grads.values():
        np.testing.assert_allclose(weight, expected)
        np.testing.assert_allclose(bias, [4.0, 4.0])
    assert job.stderr.count(MAPPED) == 1, job.output  # one line, on rank 0
    assert "backend='gloo' runs over MPI" in job.stderr
    for rank in range(4):
        assert f"rank {rank} done" in job.stdout, job.output


def test_a_default_group_of_three_of_four_ranks(launch):
    """Rank 3 never calls init_process_group; ranks 0-2 form the group and all_reduce."""
    job = run(launch, "subset", 4)
    assert job.returncode == 0, job.output
    for rank in range(3):  # 1 + 2 + 3
        assert f"rank {rank}: group rank {rank} of 3, all_reduce [6.0, 6.0]" in job.stdout
    assert "rank 3 done" in job.stdout, job.output


def test_the_two_start_ups_never_match(launch):
    """Rank 0 calls init_process_group, rank 1 init_rpc. Before: their rendezvous matched and
    both ranks waited in different MPI calls forever; now rank 0 names rank 1 as missing."""
    job = run(launch, "mixed", 2)
    assert job.returncode not in (0, None), job.output
    assert "returned although" not in job.stdout, job.output
    assert ("[rank 0] init_process_group: rank 1 of 2 did not call it within 2 s (arrived: "
            "ranks [0])") in job.stderr, job.output


@pytest.mark.parametrize("backend", ["nccl", "mpi"], ids=["nccl", "itself"])
def test_pytorch_backends_run_over_mpi(launch, backend):
    job = run(launch, f"backend:{backend}", 2)
    assert job.returncode == 0, job.output
    assert "rank 1: all_reduce [2.0, 2.0]" in job.stdout, job.output
    assert job.stderr.count(MAPPED) == (backend != "mpi"), job.output


@pytest.mark.parametrize("mode, nprocs, expected", [
    ("backend:ucc", 2, "ValueError: Invalid backend: 'ucc'; hpcgrad runs every backend over MPI "
                       "and accepts 'mpi', 'gloo', 'nccl' (or None)"),
    ("world_size:3,3", 2, "ValueError: init_process_group: world_size=3 but the MPI job has 2 "
                          "ranks; launch at least 3 ranks (mpiexec -n 3)"),
    ("rank:0,0", 2, "[rank 1] ValueError: init_process_group: rank=0 but this process is MPI "
                    "rank 1; under MPI the default group's rank r is MPI rank r"),
    ("world_size:2,2,2", 3, "[rank 2] ValueError: init_process_group: this process is MPI rank "
                            "2, outside world_size=2: the default group of world_size=2 is MPI "
                            "ranks 0-1"),
    ("world_size:3,2,3", 3, "ValueError: init_process_group: the ranks disagree on world_size: "
                            "rank 1 passed world_size=2, rank 0 passed world_size=3; every rank "
                            "of the group must pass the same world_size"),
], ids=["backend", "world_size-too-large", "rank-not-mpi", "rank-outside", "disagree"])
def test_inconsistent_start_up_is_refused(launch, mode, nprocs, expected):
    """Before: world_size and rank were ignored and any backend but 'mpi' refused."""
    job = run(launch, mode, nprocs)
    assert job.returncode not in (0, None), job.output
    assert expected in job.stderr, job.output
    if mode != "world_size:2,2,2":  # (there ranks 0-1 form their group and may all_reduce)
        assert "all_reduce" not in job.stdout, job.output


def test_a_late_rank_is_named_while_start_up_waits(launch):
    """Every wait speaks: rank 1 calls init_process_group 3.5 s late; with
    HPCGRAD_STALL_WARNING=1, rank 0 names it while waiting, the others point to rank 0, and the
    job goes on. Before: silent until the timeout."""
    job = run(launch, "late:1:3.5", 3, env={"HPCGRAD_STALL_WARNING": "1"})
    assert job.returncode == 0, job.output
    assert re.search(r"\[rank 0\] init_process_group: rank 1 of 3 not arrived after \d s "
                     r"\(arrived: ranks \[0, 2\]\); waiting on until the timeout \(20 s\)",
                     job.stderr), job.output
    assert ("[rank 2] init_process_group: waiting for 1 s; rank 0 names the ranks that have not "
            "called it") in job.stderr, job.output
    for rank in range(3):
        assert f"rank {rank} done" in job.stdout, job.output


def test_bad_start_up_arguments_locally(monkeypatch):
    """The checks that need no other rank, in this process."""
    from hpcgrad.distributed import api
    monkeypatch.setattr(api, "_default_group", None)
    with pytest.raises(TypeError, match="init_process_group: world_size must be an int, got "
                                        "str '2'"):
        dist.init_process_group(world_size="2")
    with pytest.raises(ValueError, match=r"Invalid backend: 'cpu:gloo,cuda:ucc'"):
        dist.init_process_group("cpu:gloo,cuda:ucc")
    assert api._mpi_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert api._mpi_backend("MPI") is None and api._mpi_backend(None) is None
