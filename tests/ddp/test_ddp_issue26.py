"""Issue 26's DDP rows, as launched 2-rank jobs: a static graph that changes stops every rank
before an unsynchronised step (Note [Static graph] in hpcgrad/ddp/reducer.py)."""

import sys
from pathlib import Path

import pytest

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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
