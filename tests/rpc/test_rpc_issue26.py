"""RPC as PyTorch's, on launched jobs (tests/scripts/rpc_issue26.py): shutdown waits without a
limit and serves meanwhile (Note [Quiet shutdown] in rpc/agent.py), init/shutdown cycles are
bounded and deterministic, SIGUSR2 is safe in an RPC-only job."""

import inspect
import re
import sys
from pathlib import Path

import pytest

import hpcgrad.distributed.rpc as rpc

SCRIPT = Path(__file__).parents[1] / "scripts" / "rpc_issue26.py"
BOUND = 60  # seconds: a job that hangs is killed and fails the test


def run(launch, mode, nprocs, env=None):
    job = launch([sys.executable, str(SCRIPT), mode], nprocs=nprocs, timeout=BOUND,
                 env={"HPCGRAD_COMM_TIMEOUT": "30", **(env or {})})
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    return job


def test_shutdown_waits_without_limit_as_pytorch():
    """PyTorch's default: DEFAULT_SHUTDOWN_TIMEOUT (0), no limit. Before: 60 s."""
    torch_rpc = pytest.importorskip("torch.distributed.rpc")
    from torch.distributed.rpc import constants
    default = inspect.signature(rpc.shutdown).parameters["timeout"].default
    assert default == rpc.DEFAULT_SHUTDOWN_TIMEOUT == constants.DEFAULT_SHUTDOWN_TIMEOUT == 0
    assert (inspect.signature(torch_rpc.shutdown).parameters["timeout"].default
            == constants.DEFAULT_SHUTDOWN_TIMEOUT)


def test_workers_parked_in_shutdown_serve_while_the_master_trains(launch):
    """Every PyTorch RPC example parks its workers in shutdown() while the master trains. Here
    the master trains 5 s, calling the parked workers, longer than the 2 s default RPC timeout
    (a shutdown bounded by a default -- 60 s before -- would end the workers first)."""
    job = run(launch, "park", 3)
    assert job.returncode == 0, job.output
    assert "calls served by each parked worker" in job.stdout, job.output
    for rank in range(3):
        assert f"rank {rank} done" in job.stdout, job.output


def test_shutdown_timeout_is_honoured(launch):
    """shutdown(timeout=1) on the workers while the master trains 4 s: they give up, naming it."""
    job = run(launch, "park_timeout", 3)
    assert job.returncode not in (0, None), job.output
    assert ("RpcTimeoutError: rpc.shutdown(): not every worker reached shutdown within 1 s"
            in job.stderr), job.output
    assert "rank 1 done" not in job.stdout, job.output


def test_fifty_init_shutdown_cycles_at_four_ranks(launch):
    """Each cycle leaves requests and replies in flight when shutdown starts (five rpc_async
    never waited for, RRefs dropped). Before: a sender's stop() waited 10 s for sends nobody
    would receive (4 cycles took 30-40 s, some hung); 50 cycles take ~4 s now."""
    job = run(launch, "cycles:50", 4)
    assert job.returncode == 0, job.output
    # (mpiexec may join two ranks' lines: match the words, not the lines)
    done = {(int(r), int(c)) for r, c in re.findall(r"rank (\d): cycle (\d+) ok", job.stdout)}
    assert done == {(r, c) for r in range(4) for c in range(50)}, job.output
    for rank in range(4):
        assert f"rank {rank} done" in job.stdout, job.output
    assert "WRONG" not in job.stdout


def test_sigusr2_in_an_rpc_only_job(launch):
    """SIGUSR2 (the flight recorder's dump signal) to a rank of a job with no process group.
    Before: its default action killed the rank (mpiexec: 'User defined signal 2')."""
    job = run(launch, "signal", 2)
    assert job.returncode == 0, job.output
    assert "rank 0: rank 1 sent SIGUSR2 to itself" in job.stdout, job.output
    assert "rank 0: rank 1 still serves: True" in job.stdout, job.output
    assert "rank 1 done" in job.stdout and "rank 0 done" in job.stdout, job.output


def test_allowed_refuses_while_unpickling(launch, tmp_path):
    """Rank 1 runs with init_rpc(allowed=[identity, "numpy"]). Before: os.system ran and the
    argument's __reduce__ wrote its file while the message was decoded (init_rpc had no
    allowed). Rank 0, with allowed left out, still trusts every rank, as PyTorch."""
    job = run(launch, f"allowed:{tmp_path}", 2)
    assert job.returncode == 0, job.output
    refused = ("rank 0: {} refused: RefusedGlobal on worker1 (rank 1): init_rpc(allowed=...) on "
               "'worker1' (rank 1) refuses to unpickle global '{}': not in its allowed set")
    assert refused.format("os.system", "posix.system") in job.stdout, job.output
    assert refused.format("__reduce__", "__main__.write_file") in job.stdout, job.output
    assert not (tmp_path / "system").exists() and not (tmp_path / "reduce").exists()
    assert "rank 0: allowed calls: np.float64(2.5) [1, 2, 3]" in job.stdout, job.output
    assert (tmp_path / "trusted").exists()  # the default: every rank trusted


class _WritesWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_allowed_policy_in_one_process(tmp_path):
    """The Unpickler alone, against pickle.loads as the reference of what would have run."""
    import os
    import pickle

    import numpy as np

    from hpcgrad.distributed.rpc.message import Allowed, RefusedGlobal
    policy = Allowed([os.path.join, "json"], where="here")
    evil = pickle.dumps(_WritesWhenUnpickled(tmp_path / "evil"))
    with pytest.raises(RefusedGlobal, match=r"^here refuses to unpickle global "
                                            r"'pathlib.*touch': not in its allowed set"):
        policy.loads(evil)
    assert not (tmp_path / "evil").exists()
    pickle.loads(evil)  # the reference: unrestricted, the __reduce__ runs
    assert (tmp_path / "evil").exists()
    with pytest.raises(RefusedGlobal, match="global 'posix.system'"):
        policy.loads(pickle.dumps(os.system))
    import json.decoder
    assert policy.loads(pickle.dumps(os.path.join)) is os.path.join
    assert policy.loads(pickle.dumps(json.decoder.JSONDecoder)) is json.decoder.JSONDecoder
    data = {"a": (np.float32(1.5), np.dtype("int16"), {1, 2}, complex(1, 2), np.arange(3))}
    got = policy.loads(pickle.dumps(data))
    assert got["a"][:4] == data["a"][:4] and got["a"][4].tolist() == [0, 1, 2]
    with pytest.raises(RefusedGlobal, match="global 'json.loads'"):  # envelopes: built-ins only
        policy.envelope_loads(pickle.dumps(json.loads))
    with pytest.raises(TypeError, match="allowed entries are callables, classes or module-name "
                                        "prefixes"):
        Allowed([3])
    with pytest.raises(ValueError, match="allowed entry 'my pkg' is not a module name"):
        Allowed(["my pkg"])
