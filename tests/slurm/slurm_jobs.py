"""Submitting slurm/train_ddp.sbatch and following its job on the running SLURM (tests/slurm's helpers)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "slurm/train_ddp.sbatch"
# .ci/slurm-ci.sh's simulated nodes: partition "multi", node i in network namespace hpcgrad-slurm<i>.
MULTI_PARTITION = "multi"
NODE_NETNS = "hpcgrad-slurm{}"
NODE_LINK = "hgslurm{}"  # the host end of node i's veth pair


def _controller_up():
    # `scontrol ping`, not sinfo: with the controller's address gone (slurm-ci.sh down removed the
    # bridge) sinfo retries for ~9 s, at every collection of every pytest run in tests/run.sh.
    if shutil.which("scontrol") is None or shutil.which("sbatch") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], check=False, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return ping.returncode == 0 and "is UP" in ping.stdout


_UP = _controller_up()  # once per pytest process: both test modules import this one


def slurm_running():
    return _UP


def usable_nodes(partition):
    """Names of the partition's nodes that can run a job now (none if the partition does not exist)."""
    if not _UP:
        return []
    shown = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-t", "idle,mixed,allocated,completing",
                            "-o", "%N"], check=False, capture_output=True, text=True, timeout=30)
    return sorted(set(shown.stdout.split())) if shown.returncode == 0 else []


def submit(tmp_path, *args, sbatch_args=(), env=None):
    """sbatch the script (its output in tmp_path/job-<id>.out, checkpoints in tmp_path/checkpoints);
    args go to jobs/train_ddp.py. The job id."""
    env = dict(os.environ, HPCGRAD_VENV=str(Path(sys.executable).parents[1]),
               CHECKPOINTS=str(tmp_path / "checkpoints"), **(env or {}))
    out = tmp_path / "job-%j.out"
    job = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sbatch_args, SCRIPT, *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return job.stdout.strip().split(";")[0]


def output(tmp_path, job):
    path = tmp_path / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def job_state(job):
    shown = subprocess.run(["scontrol", "show", "job", job], check=False, capture_output=True, text=True).stdout
    return shown.split("JobState=")[1].split()[0] if "JobState=" in shown else "GONE"


def wait_completed(tmp_path, job, timeout, while_waiting=None):
    """Wait until the job is COMPLETED (fail on FAILED/CANCELLED/TIMEOUT or after timeout s), calling
    while_waiting() between polls. A requeued job starts a few seconds after it pends again."""
    deadline = time.monotonic() + timeout
    requeued_at = None
    while (state := job_state(job)) != "COMPLETED":
        if time.monotonic() > deadline or state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                    "OUT_OF_MEMORY", "GONE"):
            subprocess.run(["scancel", job], check=False)
            pytest.fail(f"job {job} is {state}:\n{output(tmp_path, job)}")
        if state == "PENDING" and "requeueing" in output(tmp_path, job):
            requeued_at = requeued_at or time.monotonic()
            # SLURM holds a requeued job about 2 minutes before it may start again; a test need
            # not wait for that (a cluster's user does not notice it), but a few seconds it must:
            # a slurmd refuses a job whose credential is from the second it revoked the job's
            # last one ("Job credential revoked", and the job FAILS).
            if time.monotonic() - requeued_at > 2.5:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                               check=False, capture_output=True)
        if while_waiting is not None:
            while_waiting()
        time.sleep(0.3)
    return output(tmp_path, job)


def model_arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("model/")}


def same_arrays(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
