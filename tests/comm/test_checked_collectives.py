"""The default checks of every collective (Note [Checked collectives] in process_group.py).

Before issue 26, with no HPCGRAD_DISTRIBUTED_DEBUG set, each mismatch below returned garbage on
some rank with exit status 0 (all_reduce of 10 against 12 elements gave [2. ... 0.99999326 1.];
a rank that skipped an all_reduce matched the other's with its barrier, -3.6e19). Now every rank
raises CollectiveMismatchError naming both calls, its arrays are untouched, and the group works
on. The launched jobs run in the serial suite; the multi-rank tests below check that deferring
the data of asynchronous calls keeps them in order and correct.
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.comm import debug
from hpcgrad.comm.mpi import MPI
from hpcgrad.comm.process_group import ProcessGroup

SCRIPT = Path(__file__).parents[1] / "scripts" / "checks_mismatch.py"

# case: (what rank 0 called, what rank 1 called), as the error lists them
CASES = {
    "all_reduce-count": ("allreduce #{n}: 10 x float32, op sum",
                         "allreduce #{n}: 12 x float32, op sum"),
    "all_gather-count": ("allgather #{n}: 3 x float32", "allgather #{n}: 4 x float32"),
    "broadcast-count": ("broadcast #{n}: 10 x float32, root 0",
                        "broadcast #{n}: 12 x float32, root 0"),
    "broadcast-root": ("broadcast #{n}: 10 x float32, root 0",
                       "broadcast #{n}: 10 x float32, root 1"),
    "skipped-all_reduce": ("allreduce #{n}: 10 x float32, op sum", "barrier #{n}"),
    "reduce-op": ("allreduce #{n}: 10 x float32, op sum", "allreduce #{n}: 10 x float32, op max"),
    "float16-float32": ("allreduce #{n}: 10 x float16, op sum",
                        "allreduce #{n}: 10 x float32, op sum"),
    "int64-float64": ("allreduce #{n}: 10 x int64, op sum", "allreduce #{n}: 10 x float64, op sum"),
    "complex64-float64": ("allreduce #{n}: 10 x complex64, op sum",
                          "allreduce #{n}: 10 x float64, op sum"),
    "bool-uint8": ("allreduce #{n}: 10 x bool, op sum", "allreduce #{n}: 10 x uint8, op sum"),
    "float32-int32": ("allreduce #{n}: 10 x float32, op sum",
                      "allreduce #{n}: 10 x int32, op sum"),
}

_jobs = {}


def job(launch, mode):
    """One 2-rank job runs every case (blocking, or async_op=True then wait), default settings."""
    if mode not in _jobs:
        args = [sys.executable, str(SCRIPT), *CASES] + (["--async"] if mode == "async" else [])
        env = {"HPCGRAD_DISTRIBUTED_DEBUG": "INFO"}  # the default, whatever the caller's is
        _jobs[mode] = launch(args, nprocs=2, timeout=90, mpiexec_timeout=60, env=env)
    return _jobs[mode]


@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatch_raises_on_every_rank_before_any_data_moves(launch, mode, case):
    result = job(launch, mode)
    assert result.returncode == 0 and not result.timed_out, result.output
    n = 2 * list(CASES).index(case) + 1  # each case is followed by one matching all_reduce
    usual, odd = (c.format(n=n) for c in CASES[case])
    for rank in range(2):
        line = re.search(rf"^\[rank {rank}\] {case}: caught CollectiveMismatchError: ranks "
                         rf"called different collectives at call #{n} .*$", result.stdout, re.M)
        assert line, f"rank {rank} did not raise on {case}:\n{result.output}"
        assert f"|   rank 0: {usual} |   rank 1: {odd}" in line.group(0), line.group(0)
        assert f"[rank {rank}] {case}: untouched True" in result.stdout, result.output
        assert f"[rank {rank}] {case}: afterwards all_reduce gives [3.0, 3.0]" in result.stdout
    assert "no error" not in result.stdout, result.output


def test_the_checks_are_on_by_default(monkeypatch):
    monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5.0)
    try:
        assert isinstance(group._checker, debug.FingerprintChecker)
    finally:
        group.free()


def test_the_fingerprint_tells_every_field_apart():
    base = dict(seq=3, name="allreduce", array=np.ones(10, np.float32), extra={"reduce_op": "sum"})
    fp = debug.FingerprintChecker.fingerprint
    first = fp(**base)
    others = [fp(**{**base, "seq": 4}), fp(**{**base, "name": "broadcast"}),
              fp(**{**base, "array": np.ones(11, np.float32)}),
              fp(**{**base, "array": np.ones(10, np.int32)}),
              fp(**{**base, "extra": {"reduce_op": "max"}}),
              fp(**{**base, "extra": {"reduce_op": "sum", "src": 0}})]
    hashes = {hash(first) >> 1} | {hash(o) >> 1 for o in others}
    assert len(hashes) == 1 + len(others)


# --- multi-rank: deferred data keeps call order ----------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_async_calls_waited_in_any_order_give_the_right_sums():
    dist.init_process_group()
    group = dist.new_group()
    try:
        size, rank = group.size(), group.rank()
        arrays = [np.full(n, rank + 1.0 + i, np.float64 if i % 2 else np.float32)
                  for i, n in enumerate([1, 1000, 7, 50_000, 3, 1])]
        works = [group.iallreduce(a) for a in arrays]
        total = sum(range(1, size + 1))
        for i in reversed(range(len(works))):  # the last first: earlier data must go first
            works[i].wait()
            assert np.all(arrays[i] == total + size * i), (i, arrays[i][:3])
        assert not group._deferred
        # a blocking call after asynchronous ones that nobody waited for yet
        pending = [group.ibroadcast(np.full(4, float(rank)), 0) for _ in range(3)]
        x = np.ones(5)
        group.iallreduce(x, blocking=True)
        assert x.tolist() == [float(size)] * 5
        for w in pending:
            w.wait()
    finally:
        dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
def test_an_async_mismatch_leaves_later_async_calls_working():
    dist.init_process_group()
    group = dist.new_group()
    try:
        rank, size = group.rank(), group.size()
        bad = group.iallreduce(np.ones(3 if rank == 0 else 4, np.float32))
        good = group.iallreduce(np.full(2, 1.0))
        with pytest.raises(debug.CollectiveMismatchError, match="at call #1"):
            bad.wait()
        good.wait()
        again = np.full(2, 1.0)
        group.iallreduce(again, blocking=True)
        assert again.tolist() == [float(size)] * 2
    finally:
        dist.destroy_process_group(group)
