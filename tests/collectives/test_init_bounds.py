"""Start-up is bounded: a rank that never calls init_process_group, init_rpc or new_group ends
the job within the timeout, rank 0 naming it (Note [Bounded start-up] in comm/rendezvous.py), and
bad timeouts are clear errors."""

import datetime
import sys
from pathlib import Path

import pytest

import hpcgrad.distributed as dist
from hpcgrad.comm.mpi import comm_world
from hpcgrad.distributed import rpc

SCRIPT = Path(__file__).parents[1] / "scripts" / "init_missing.py"
BOUND = 60  # seconds: a job that hangs is killed and fails the test (they end in a few seconds)


@pytest.mark.parametrize("mode, missing, expected", [
    ("init_process_group", 2, ("[rank 0] init_process_group: rank 2 of 3 did not call it "
                               "within 2 s (arrived: ranks [0, 1])")),
    ("env", 0, ("] init_process_group: not every rank of 3 called it within 2 s (rank 0 "
                "names the missing ranks, unless it is one of them)")),
    ("init_rpc", 1, ("[rank 0] init_rpc: rank 1 of 3 did not call it within 2 s (arrived: "
                     "ranks [0, 2])")),
    ("new_group", 1, ("CommTimeoutError: new_group(ranks=[0, 1]): not every rank of the "
                      "default group called new_group within 2 s")),
], ids=["init_process_group", "env-rank0-missing", "init_rpc", "new_group"])
def test_a_missing_rank_ends_start_up(launch, mode, missing, expected):
    """Before: init_process_group and init_rpc waited in MPI_Comm_dup forever."""
    job = launch([sys.executable, str(SCRIPT), mode, str(missing)], nprocs=3, timeout=BOUND,
                 env={"HPCGRAD_COMM_TIMEOUT": "2"})
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    assert job.returncode not in (0, None), job.output
    assert expected in job.stderr, job.output
    assert "returned although" not in job.stdout, job.output
    if mode != "new_group":
        assert "MPI_Abort(COMM_WORLD, 1)" in job.stderr and "every rank must call" in job.stderr


@pytest.mark.parametrize("timeout, error, match", [
    (-1, ValueError, (r"init_process_group: timeout must be a finite number of seconds >= 0 "
                      r"\(0: no limit\), got -1")),
    (float("nan"), ValueError, "got nan"),
    (datetime.timedelta(seconds=-5), ValueError, "got datetime.timedelta"),
    ("30", TypeError, "must be a number of seconds or a datetime.timedelta, got str '30'"),
    (True, TypeError, "got bool True"),
])
def test_init_process_group_rejects_bad_timeouts(timeout, error, match):
    with pytest.raises(error, match=match):
        dist.init_process_group(timeout=timeout)


def test_new_group_rejects_bad_timeouts(world):
    with pytest.raises(ValueError, match=r"new_group: timeout must be a finite number"):
        dist.new_group(timeout=-2)


def test_init_rpc_options_as_pytorch():
    """rpc_timeout of the backend options becomes the default RPC timeout (PyTorch's names)."""
    if comm_world().Get_size() != 1:
        pytest.skip("starts and stops RPC by itself: one process")
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("me", backend="gloo")
    with pytest.raises(TypeError, match="rpc_backend_options must be an instance of RpcBackendOptions"):
        rpc.init_rpc("me", rpc_backend_options={"rpc_timeout": 5})
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=7, num_worker_threads=2,
                                              init_method="env://")
    rpc.init_rpc("me", rank=-1, rpc_backend_options=options)
    try:
        assert rpc.get_rpc_timeout() == 7
        assert rpc.rpc_sync("me", divmod, args=(7, 2)) == (3, 1)
    finally:
        rpc.shutdown(timeout=30)
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)
