"""Diagnostics tell the truth (issue 26): one stall warning agreed by all ranks, no unpickling of
diagnostics messages, SIGUSR2 without a process group, groups named as registered, and a
flight tool that names the ranks whose records are missing."""

import sys
from pathlib import Path

import numpy as np
import pytest

from hpcgrad.comm import stall

SCRIPTS = Path(__file__).parents[1] / "scripts"
BOUND = 60  # seconds: a job that hangs is killed and fails the test (they end in a few seconds)


class _Gathered:
    """A communicator whose Allgather returns the given ranks' values (rank ``rank`` of them)."""

    def __init__(self, values, rank=0):
        self.values, self.rank = values, rank

    def Get_size(self):
        return len(self.values)

    def Get_rank(self):
        return self.rank

    def Allgather(self, send, recv):
        assert send[0] == self.values[self.rank] or np.isnan(send[0])
        recv[:] = self.values


class _Out(list):
    def write(self, text):
        self.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("values, agreed", [([60.0, 1.0], 1.0), ([0.0, 5.0, 2.0], 2.0),
                                            ([0.0, 0.0], 0.0), ([3.0, 3.0], 3.0)])
def test_the_ranks_agree_on_the_smallest_warning_that_is_on(values, agreed):
    out = _Out()
    assert stall.agree_warning(_Gathered(values), values[0], out) == agreed
    if len(set(values)) == 1:
        assert out == []
    else:
        assert len(out) == 1 and out[0].endswith("\n"), out
        assert out[0].startswith("[hpcgrad stall inspector] HPCGRAD_STALL_WARNING differs across "
                                 "ranks ("), out
        assert f"every rank uses the smallest setting that is on: {agreed:g} s" in out[0], out


def test_only_rank_0_says_the_ranks_differ():
    out = _Out()
    assert stall.agree_warning(_Gathered([60.0, 1.0], rank=1), 1.0, out) == 1.0
    assert out == []


def test_a_bad_setting_on_one_rank_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv(stall.WARNING_ENV, "2")
    with pytest.raises(ValueError, match=r"HPCGRAD_STALL_WARNING on rank 1 is not a number of "
                                         r"seconds >= 0"):
        stall.agree_warning(_Gathered([2.0, float("nan")]), None, _Out())
    monkeypatch.setenv(stall.WARNING_ENV, "soon")
    with pytest.raises(ValueError, match=r"HPCGRAD_STALL_WARNING must be a number of seconds"):
        stall.agree_warning(_Gathered([float("nan"), 2.0]), None, _Out())


@pytest.mark.parametrize("warnings", [",1", "0,1"], ids=["unset-and-1", "off-and-1"])
def test_a_stall_is_reported_when_the_ranks_set_different_warnings(launch, tmp_path, warnings):
    """Rank 1 reaches the second all_reduce 3 s late. Before: rank 0 inspected at its own 60 s
    and the stall was silent; with 0 on rank 0, rank 1 alone duplicated the communicator."""
    job = launch([sys.executable, str(SCRIPTS / "stall_disagree.py")], nprocs=2, timeout=BOUND,
                 env={"STALL_WARNINGS": warnings, "HPCGRAD_FLIGHT_DIR": str(tmp_path),
                      # The stall inspector alone: a call check's own wait is another matter.
                      "HPCGRAD_DISTRIBUTED_DEBUG": "OFF"})
    assert job.returncode == 0 and not job.timed_out, job.output
    for rank in range(2):
        assert f"[rank {rank}] done" in job.stdout, job.output
    first = "60 s on rank 0" if warnings == ",1" else "0 (off) on rank 0"
    assert (f"[hpcgrad stall inspector] HPCGRAD_STALL_WARNING differs across ranks (") in job.stderr
    assert first in job.stderr and "1 s on rank 1" in job.stderr, job.stderr
    assert "every rank uses the smallest setting that is on: 1 s" in job.stderr, job.stderr
    assert ("[hpcgrad stall inspector] allreduce #2 (4 x float32) on group 0 (default, world "
            "ranks 0, 1) has waited ") in job.stderr, job.stderr
    assert "; not reached by rank 1 (over HPCGRAD_STALL_WARNING=1 s)." in job.stderr, job.stderr
