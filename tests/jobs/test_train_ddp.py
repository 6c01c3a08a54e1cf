"""jobs/train_ddp.py end to end: it learns, and stop + --resume equals an uninterrupted run bitwise.

Two launched runs are shared (module fixtures, each launched once): an uninterrupted 6-epoch run
with a timeline (learning, reporting, the reference of stop + resume, resume at another world
size) and one stopped at step 30, in the middle of epoch 2 (resume; refusal at 3 ranks). A test
that resumes or changes one works on a copy.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import launching
import numpy as np
import pytest
from job_processes import rank_pid

from hpcgrad.comm.mpi import comm_world

pytest.importorskip("sklearn")
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "train_ddp.py")


def train(launch, checkpoint_dir, *args, env=None):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(checkpoint_dir), "--no-progress",
                     *args], nprocs=2, timeout=120, env=env)
    assert not result.failed, result.output
    return result


EPOCHS = 6  # the shared runs' --epochs: the learning test's (a seeded run reaches ~0.95-0.98)


def copy_of(run, tmp_path):
    """A copy of a shared run's directory, for a test that resumes from it."""
    return Path(shutil.copytree(run[0], tmp_path / run[0].name))


def epoch_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("epoch ")]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted run of EPOCHS epochs at 2 ranks, with a timeline: (directory, result)."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    directory = tmp_path_factory.mktemp("whole")
    return directory, train(launching.run_job, directory, "--epochs", str(EPOCHS),
                            "--tensorboard",
                            env={"HPCGRAD_TIMELINE": str(directory / "timeline.json")})


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The same run stopped by --max-steps 30, in the middle of epoch 2, with a timeline:
    (directory, result)."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    directory = tmp_path_factory.mktemp("stopped")
    return directory, train(launching.run_job, directory, "--epochs", str(EPOCHS),
                            "--max-steps", "30",
                            env={"HPCGRAD_TIMELINE": str(directory / "timeline.json")})


def model_arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("model/")}


def test_ddp_job_learns_digits(whole):
    _, result = whole
    accuracy = float(epoch_lines(result.stdout)[-1].split("test accuracy")[1].split()[0])
    assert accuracy > 0.9, result.stdout  # seeded run: ~0.95-0.98


def test_stop_and_resume_matches_uninterrupted_run(launch, tmp_path, whole, stopped):
    assert "stopped at step 30" in stopped[1].stdout
    pieces = copy_of(stopped, tmp_path)
    resumed = train(launch, pieces, "--epochs", str(EPOCHS), "--resume")
    assert "resumed from" in resumed.stdout and "epoch 1, step 30" in resumed.stdout
    assert "loss" in resumed.stdout and "(steps 31-23 only" not in resumed.stdout
    a, b = model_arrays(whole[0] / "last.npz"), model_arrays(pieces / "last.npz")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_stopped_job_merges_its_timeline(stopped):
    directory, result = stopped
    assert f"timeline: {directory / 'timeline.json'}" in result.stdout
    events = json.loads((directory / "timeline.json").read_text())["traceEvents"]
    for rank in (0, 1):  # both ranks' steps, up to the stop's checkpoint
        steps = {e["args"]["step"] for e in events
                 if e.get("pid") == rank and e["ph"] == "B" and e["name"] == "backward"}
        assert steps == set(range(1, 31))
        assert any(e["name"] == "checkpoint" for e in events if e.get("pid") == rank)


def test_resume_without_checkpoint_says_how_to_fix(launch, tmp_path):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--resume"],
                    nprocs=2, timeout=60)
    assert result.failed and "no checkpoint at" in result.output


def test_job_reports_metrics_timeline_and_each_test_sample_once(launch, tmp_path, whole):
    directory, result = whole
    assert "2 ranks on 1 node;" in result.stdout and "global batch 64" in result.stdout
    assert result.stdout.count(f"epoch {EPOCHS}/{EPOCHS}") == 1  # rank 0 reports, once
    assert "DDP: 1 bucket(s) of" in result.stdout and "rebuilt in gradient order" in result.stdout
    epochs = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()
              if '"epoch", "step"' in line or line.startswith('{"kind": "epoch"')]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    for e in epochs:
        assert e["samples_per_s"] > 0 and e["test_loss"] > 0
        # digits' test split has 359 samples: an accuracy over each exactly once is k / 359
        # (DistributedSampler's padding counted one twice: k / 360)
        assert abs(e["test_accuracy"] * 359 - round(e["test_accuracy"] * 359)) < 1e-9
    events = json.loads((directory / "timeline.json").read_text())["traceEvents"]
    for rank in (0, 1):
        names = {e["name"] for e in events if e.get("pid") == rank and e["ph"] == "B"}
        assert {"forward", "backward", "optimizer step", "checkpoint"} <= names
    tensorboard = list((directory / "tensorboard").glob("events.out.tfevents.*"))
    assert len(tensorboard) == 1, tensorboard  # rank 0's alone
    written = tensorboard[0].read_bytes()
    assert b"step/loss" in written and b"epoch/test_accuracy" in written
    again = train(launch, copy_of(whole, tmp_path), "--epochs", str(EPOCHS), "--resume")
    assert f"is complete ({EPOCHS} of {EPOCHS} epochs); nothing to train" in again.stdout
    assert f"epoch 1/{EPOCHS}" not in again.stdout


def test_tensorboard_without_tensorboardx_is_refused_before_training(launch, tmp_path):
    missing = tmp_path / "no-tensorboardx" / "tensorboardX"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('not installed (a test)')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(missing.parent)] + sys.path)}
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path / "run"),
                     "--tensorboard"], timeout=60, env=env)
    assert result.returncode == 2, result.output
    assert "--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_arguments_are_checked_before_training(launch, tmp_path):
    bad = launch([sys.executable, JOB, "--momentum", "7"], timeout=60)
    assert bad.returncode == 2 and "expected a finite number >= 0 and < 1 (SGD momentum)" in bad.stderr
    too_big = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--batch-size", "5000"],
                     nprocs=2, timeout=60)
    assert too_big.failed and too_big.stderr.count("--batch-size 5000 is larger than each rank") == 1
    assert "719 at 2 ranks" in too_big.stderr
    unwritable = launch([sys.executable, JOB, "--checkpoint-dir", "/proc/hpcgrad-no-such-dir"],
                        nprocs=2, timeout=60)
    assert unwritable.failed and "is not writable" in unwritable.stderr
    assert "epoch 1/" not in unwritable.stdout


def test_resume_at_another_world_size(launch, tmp_path, whole, stopped):
    """At an epoch boundary the run goes on at any world size; mid-epoch it refuses, saying how."""
    a = copy_of(whole, tmp_path)
    more = str(EPOCHS + 1)
    wider = launch([sys.executable, JOB, "--checkpoint-dir", str(a), "--no-progress",
                    "--epochs", more, "--resume"], nprocs=3, timeout=120)
    assert not wider.failed, wider.output
    assert f"saved by 2 ranks; continuing at 3 from the start of epoch {more}" in wider.stdout
    assert f"epoch {more}/{more}" in wider.stdout
    refused = launch([sys.executable, JOB, "--checkpoint-dir", str(copy_of(stopped, tmp_path)),
                      "--resume"], nprocs=3, timeout=120)
    assert refused.failed and "saved by 2 ranks in the middle of epoch 2" in refused.stderr
    assert "Resume with 2 ranks" in refused.stderr


def test_ctrl_c_on_one_rank_checkpoints_with_one_line(launch, tmp_path):
    """SIGINT to rank 1 alone (as Ctrl-C, SIGTERM or SLURM's SIGUSR1): every rank stops at the
    next step after a checkpoint, one line says so, no traceback, PREEMPTED is left for the
    requeue, the job exits 130 (128 + SIGINT: stopped, resumable), and --resume finishes the
    run and clears it."""
    outcome = {}
    job = threading.Thread(target=lambda: outcome.update(result=launch(
        [sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--no-progress", "--epochs", "20"],
        nprocs=2, timeout=120)))
    job.start()
    deadline = time.monotonic() + 60
    pid = rank_pid(JOB, tmp_path, 1, deadline)
    metrics = tmp_path / "metrics.jsonl"
    while time.monotonic() < deadline and not (
            metrics.exists() and metrics.read_text().count('"kind": "step"') >= 3):
        time.sleep(0.02)
    os.kill(pid, signal.SIGINT)
    job.join(120)
    stopped = outcome["result"]
    assert stopped.returncode == 130 and "Traceback" not in stopped.output, stopped.output
    assert stopped.stdout.count("stopped at step") == 1 and "epoch 20/20" not in stopped.stdout
    assert (tmp_path / "PREEMPTED").exists()
    resumed = train(launch, tmp_path, "--epochs", "2", "--resume")
    assert "resumed from" in resumed.stdout and not (tmp_path / "PREEMPTED").exists()


def test_preemption_notice_after_the_run_is_ignored():
    """A USR1 or TERM that arrives once main() has returned (SLURM's notice racing the end of the
    run) must not kill the finished process, whose status the scheduler reads as the job's."""
    import subprocess
    code = ("import os, signal; "
            "from hpcgrad.training.loop import Preemption; Preemption.ignore_from_now(); "
            "os.kill(os.getpid(), signal.SIGUSR1); os.kill(os.getpid(), signal.SIGTERM); "
            "print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "still here" in done.stdout, done.stderr
