"""An RPC to a worker that died fails fast, naming it, and the survivors' distributed autograd
contexts that reached it are released (tests/elastic/scripts/rpc_peer_death.py, under ULFM;
Note [RPC to a dead rank] in hpcgrad/rpc/agent.py)."""

import re

import pytest

from elastic_jobs import run_ft_job

NAMED = "RPC to worker 'worker2' (rank 2) failed: that process died"


def _checks(output):
    return dict(re.findall(r"^CHECK (\w+): (.*)$", output, re.MULTILINE))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exit", "kill9"])
def test_rpc_to_a_dead_worker_fails_fast_naming_it(tmp_path, mode):
    """Rank 2 dies (os._exit(9), or SIGKILL) while rank 0 waits for its reply under a 60 s RPC
    timeout: the reply fails within seconds naming rank 2, a new call to it fails at once,
    ranks 0 and 1 go on talking, the context that reached rank 2 is released on ranks 0 and 1
    (one that did not is kept) and the survivors' rpc.shutdown() ends. mpirun's exit status is
    the dead rank's: the job is judged by the survivors' output."""
    job = run_ft_job("rpc_peer_death.py", 3, [mode, tmp_path], timeout=60)
    assert not job.timed_out, job.output[-3000:]
    checks = _checks(job.stdout)
    assert (tmp_path / "killed.json").exists(), job.output[-3000:]
    assert checks.get("rref_before") == "7", job.output[-3000:]
    # the pending call: failed by the death, not by its 60 s timeout
    assert checks["pending"].startswith(f"ProcessFailure: {NAMED}"), checks
    assert "RPC long_call to worker2 (rank 2) did not complete" in checks["pending"]
    assert float(checks["pending_seconds"]) < 5.0, checks
    for name in ("new_sync", "rref"):  # refused at once, naming the dead worker
        seconds, message = re.match(r"ProcessFailure in (\S+) s: (.*)", checks[name]).groups()
        assert float(seconds) < 0.5 and message.startswith(NAMED), checks[name]
    assert checks["worker1"] == "still here"
    # backward in the released context fails at once, naming the dead worker
    seconds, message = re.match(r"ProcessFailure in (\S+) s: (.*)", checks["backward"]).groups()
    assert float(seconds) < 0.5 and "it was released" in message and NAMED in message, message
    assert checks["contexts"] == "2 -> 1", checks  # released on rank 0; the other one kept
    assert checks["rank1_contexts"] == "1", checks  # and on rank 1, by rank 0's release
    assert checks["other_context"] == "alive", checks
    for rank in (0, 1):  # both survivors' shutdown ended, promptly
        found = re.search(rf"^SHUTDOWN rank {rank} in (\S+) s$", job.stdout, re.MULTILINE)
        assert found and float(found.group(1)) < 20.0, job.output[-3000:]
    print(f"\n{mode}: rank 2's death -> rank 0's pending future failed in "
          f"{checks['pending_seconds']} s")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_backward_pass_fails_fast_when_a_worker_dies_in_its_part(tmp_path):
    """Rank 2 dies running its part of rank 0's dist_autograd.backward (60 s pass timeout):
    backward raises within seconds naming rank 2, the context is released on ranks 0 and 1,
    and the survivors go on and shut down."""
    job = run_ft_job("rpc_peer_death.py", 3, ["backward", tmp_path], timeout=60)
    assert not job.timed_out, job.output[-3000:]
    checks = _checks(job.stdout)
    assert "backward_running" in checks, job.output[-3000:]
    seconds, message = re.match(r"ProcessFailure in (\S+) s: (.*)",
                                checks["backward_running"]).groups()
    assert message.startswith(f"Error on Node 0: {NAMED}"), message
    assert float(checks["pending_seconds"]) < 5.0, checks
    assert checks["contexts"] == "1 -> 0" and checks["rank1_contexts"] == "0", checks
    assert checks["worker1"] == "still here" and checks["new_sync"].startswith("ProcessFailure")
    for rank in (0, 1):
        assert re.search(rf"^SHUTDOWN rank {rank} in ", job.stdout, re.MULTILINE), job.output
    print(f"\nbackward: rank 2's death -> rank 0's backward failed in "
          f"{checks['pending_seconds']} s")
