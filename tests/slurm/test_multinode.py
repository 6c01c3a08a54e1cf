"""slurm/train_ddp.sbatch with -N 2 on .ci/slurm-ci.sh's simulated nodes: srun, mpiexec, preemption and requeue.

Skipped where that SLURM is not running (.ci/run starts it with .ci/slurm-ci.sh up, as root).
"""

import collections
import subprocess
import sys
import time
from pathlib import Path

import launching  # tests/launching.py: run_job, the bounded launcher
import pytest
from slurm_jobs import (
    MULTI_PARTITION,
    NODE_LINK,
    NODE_NETNS,
    ROOT,
    job_state,
    model_arrays,
    output,
    same_arrays,
    slurm_running,
    submit,
    usable_nodes,
    wait_completed,
)

from hpcgrad.comm.mpi import comm_world

NODES = ("node1", "node2")


def _skip_reason():
    if not slurm_running():
        return "no running SLURM (start one with .ci/slurm-ci.sh up)"
    missing = set(NODES) - set(usable_nodes(MULTI_PARTITION))
    if missing:
        return (f"no multi-node SLURM: partition '{MULTI_PARTITION}' lacks usable {', '.join(sorted(missing))} "
                "(.ci/slurm-ci.sh up makes them as root with network namespaces; see "
                "/tmp/hpcgrad-slurm-up.log in CI and /var/log/slurm)")
    return None


_WHY = _skip_reason()
pytestmark = [pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
              pytest.mark.skipif(comm_world().Get_size() > 1,
                                 reason="submits its own SLURM jobs; runs in the serial suite")]
pytest.importorskip("sklearn")

EPOCHS = "3"
TWO_NODES = ("--partition", MULTI_PARTITION, "--nodes", "2", "--ntasks-per-node", "2")
# Bytes through node2's link for the whole job: ~2.5 MB over ofi/tcp for 4 epochs, ~34 KB when
# MPICH's ucx moves the gradients through shared memory instead (measured; see the sbatch script).
MIN_LINK_BYTES = 500_000


class RankWatch:
    """Where the job's ranks run, seen from outside the job: the train_ddp.py processes in each
    node's network namespace, and the hostname each one sees (its UTS namespace)."""

    def __init__(self):
        self.seen = {}  # pid -> (node number, hostname)

    def __call__(self):
        for i in range(1, len(NODES) + 1):
            pids = subprocess.run(["ip", "netns", "pids", NODE_NETNS.format(i)], check=False, capture_output=True,
                                  text=True).stdout.split()
            for pid in set(pids) - set(self.seen):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue  # ended meanwhile
                # a rank is `python jobs/train_ddp.py ...`, not the srun/mpiexec line that names it
                if len(argv) < 2 or not Path(argv[0].decode()).name.startswith("python") \
                        or argv[1] != b"jobs/train_ddp.py":
                    continue
                host = subprocess.run(["nsenter", "--target", pid, "--uts", "hostname"],
                                      check=False, capture_output=True, text=True).stdout.strip()
                self.seen[pid] = (i, host)

    def ranks_per_node(self):
        return dict(collections.Counter(f"node{i}={host}" for i, host in self.seen.values()))


def link_bytes(node=2):
    stats = Path(f"/sys/class/net/{NODE_LINK.format(node)}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same job, 4 ranks under plain mpiexec on this machine, never stopped."""
    where = tmp_path_factory.mktemp("one-machine")
    done = launching.run_job([sys.executable, str(ROOT / "jobs" / "train_ddp.py"), "--epochs", EPOCHS,
                             "--checkpoint-dir", str(where), "--no-progress"], nprocs=4, timeout=240)
    assert not done.failed, done.output
    return model_arrays(where / "last.npz")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_two_node_job_trains_as_on_one_machine(tmp_path, launcher, uninterrupted):
    """sbatch -N 2 --ntasks-per-node=2: two ranks in each node's namespace, seeing its hostname,
    gradients crossing node2's link, and the parameters of the one-machine run, bit for bit."""
    watch, before = RankWatch(), link_bytes()
    job = submit(tmp_path, "--epochs", EPOCHS, sbatch_args=TWO_NODES,
                 env={"HPCGRAD_LAUNCHER": launcher})
    log = wait_completed(tmp_path, job, timeout=240, while_waiting=watch)
    crossed = link_bytes() - before
    assert f"4 ranks on 2 node(s) (node[1-2]), launcher {launcher}" in log, log
    assert "hpcgrad DDP job: 4 ranks on 2 nodes" in log, log  # the ranks' own hostnames, gathered
    assert f"epoch {EPOCHS}/{EPOCHS}" in log, log
    assert watch.ranks_per_node() == {"node1=node1": 2, "node2=node2": 2}, (watch.seen, log)
    assert crossed > MIN_LINK_BYTES, f"only {crossed} bytes crossed node2's link:\n{log}"
    assert same_arrays(uninterrupted, model_arrays(tmp_path / "checkpoints" / "last.npz"))


@pytest.mark.timeout(480)
def test_preempted_two_node_job_requeues_itself_and_finishes_like_an_uninterrupted_run(tmp_path,
                                                                                      uninterrupted):
    """scancel --signal=USR1 once the ranks on both nodes train: every rank checkpoints, the script
    requeues the same job id, and its second run (again on two nodes) resumes and ends with the
    one-machine run's parameters."""
    job = submit(tmp_path, "--epochs", EPOCHS, sbatch_args=TWO_NODES)
    metrics = tmp_path / "checkpoints" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    # The first step's metrics line: every rank is past its signal handler's set-up, and the
    # first epoch (the slow one: compilation) still has most of its steps to go.
    while not (metrics.exists() and '"kind": "step"' in metrics.read_text()):
        assert time.monotonic() < deadline, f"the job did not start training:\n{output(tmp_path, job)}"
        assert job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), output(tmp_path, job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    log = wait_completed(tmp_path, job, timeout=300)  # --open-mode=append: both runs in one file
    assert "stopped at step" in log and "preempted: requeueing job" in log, log
    assert "run 2," in log and "resumed from" in log, log
    assert log.count("4 ranks on 2 node(s) (node[1-2])") == 2, log
    assert log.count(f"epoch {EPOCHS}/{EPOCHS}") == 1, log
    assert not (tmp_path / "checkpoints" / "PREEMPTED").exists()
    assert same_arrays(uninterrupted, model_arrays(tmp_path / "checkpoints" / "last.npz"))
