"""jobs/train_pipeline.py end to end: a model split across 2 and 3 ranks learns digits and ends at its
best, reports like the DDP job, and stop (steps, a signal) + --resume equals an uninterrupted run."""

import importlib.util
import json
import os
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
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "train_pipeline.py")
TEST_SAMPLES = 359  # digits' test split


def train(launch, checkpoint_dir, *args, ranks=2, env=None):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(checkpoint_dir), "--no-progress",
                     *args], nprocs=ranks, timeout=120, env=env)
    assert not result.failed, result.output
    return result


def epoch_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("epoch ")]


def figure(line, name):
    """The number after ``name`` in an epoch line."""
    return float(line.split(f"{name} ")[1].split()[0])


def stage_arrays(directory, ranks=2):
    """Every rank's parameters and momentum buffers, by rank and name, in the newest commit."""
    manifest = json.loads(max(directory.glob("commit-*.json")).read_text())
    assert manifest["world_size"] == ranks
    arrays = {}
    for part in manifest["parts"]:
        with np.load(directory / part["file"]) as f:
            arrays.update({(part["rank"], k): f[k] for k in f.files if k != "__meta__"})
    return arrays


def assert_same_arrays(a, b):
    assert a.keys() == b.keys()
    different = [key for key in a if not np.array_equal(a[key], b[key])]
    assert not different, different


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted 2-epoch run at 2 ranks: (its directory, its output)."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    directory = tmp_path_factory.mktemp("whole")
    return directory, train(launching.run_job, directory, "--epochs", "2")


@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_job_learns_and_ends_at_its_best(launch, tmp_path, ranks):
    """Before Note [Pipeline job's learning]: 0.93 at epoch 4, 0.84 at epoch 5 (2 ranks)."""
    timeline = tmp_path / "timeline.json"
    result = train(launch, tmp_path, ranks=ranks, env={"HPCGRAD_TIMELINE": str(timeline)})
    assert f"{ranks} ranks on 1 node, one stage each; batch 32; lr 0.05" in result.stdout
    assert "stages: rank 0: Linear 64>128" in result.stdout
    assert "data: 1438 train / 359 test samples" in result.stdout
    assert result.stdout.count("arguments: ") == 1  # printed once, by rank 0
    epochs = epoch_lines(result.stdout)
    assert [line.split()[1] for line in epochs] == [f"{e}/5" for e in range(1, 6)], result.stdout
    accuracies = [figure(line, "test accuracy") for line in epochs]
    assert accuracies[-1] > 0.9 and accuracies[-1] >= max(accuracies) - 0.03, result.stdout
    assert all("samples/s" in line for line in epochs)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_epoch = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in per_epoch] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 5 * 45 + 1))
    for r, line in zip(per_epoch, epochs):
        assert r["samples_per_s"] > 0 and r["test_loss"] > 0
        assert f"test accuracy {r['test_accuracy']:.4f}" in line
        k = r["test_accuracy"] * TEST_SAMPLES  # each test sample counted exactly once
        assert abs(k - round(k)) < 1e-4
    events = json.loads(timeline.read_text())["traceEvents"]
    for rank in range(ranks):
        names = {e["name"] for e in events if e.get("pid") == rank and e["ph"] == "B"}
        assert {"forward", "backward", "optimizer step", "checkpoint"} <= names, (rank, names)


def test_stop_and_resume_matches_uninterrupted_run(launch, tmp_path, whole):
    directory, uninterrupted = whole
    stopped = train(launch, tmp_path, "--epochs", "2", "--max-steps", "30")
    assert "stopped at step 30" in stopped.stdout
    assert not (tmp_path / "PREEMPTED").exists()  # --max-steps is no preemption
    resumed = train(launch, tmp_path, "--epochs", "2", "--resume")
    assert "resumed from" in resumed.stdout and "epoch 0, step 30" in resumed.stdout
    # The resumed epoch's figures cover the whole epoch: the same as the uninterrupted run's.
    first, again = epoch_lines(uninterrupted.stdout)[0], epoch_lines(resumed.stdout)[0]
    assert first.split("  ")[:5] == again.split("  ")[:5], (first, again)
    assert "(resumed after step 30 of 45" in again
    assert_same_arrays(stage_arrays(directory), stage_arrays(tmp_path))


def test_ctrl_c_on_one_rank_stops_every_rank_and_resume_is_exact(launch, tmp_path, whole):
    """SIGINT (as SIGTERM or SIGUSR1) to rank 1 alone: all ranks agree at the next step,
    checkpoint, leave PREEMPTED and exit 130 (128 + SIGINT) without a traceback; --resume ends
    bitwise equal."""
    directory, _ = whole
    outcome = {}
    job = threading.Thread(target=lambda: outcome.update(result=launch(
        [sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--no-progress", "--epochs",
         "2", "--checkpoint-every", "0"], nprocs=2, timeout=120)))
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
    assert stopped.returncode == 130 and not stopped.timed_out, stopped.output
    assert "stopped at step" in stopped.stdout and "Traceback" not in stopped.output
    assert "by SIGINT (exit status 130)" in stopped.stdout
    assert int(stopped.stdout.split("stopped at step ")[1].split()[0]) < 90
    assert (tmp_path / "PREEMPTED").exists()
    train(launch, tmp_path, "--epochs", "2", "--resume")
    assert not (tmp_path / "PREEMPTED").exists()
    assert_same_arrays(stage_arrays(directory), stage_arrays(tmp_path))


def test_finished_run_says_so_and_trains_nothing(launch, whole):
    directory, _ = whole
    before = stage_arrays(directory)
    again = train(launch, directory, "--epochs", "2", "--resume")
    assert "is complete (2 of 2 epochs); nothing to train" in again.stdout
    assert not epoch_lines(again.stdout)
    assert_same_arrays(before, stage_arrays(directory))


def test_resume_at_another_world_size_is_refused(launch, whole):
    directory, _ = whole
    refused = launch([sys.executable, JOB, "--checkpoint-dir", str(directory), "--resume"],
                     nprocs=3, timeout=60)
    assert refused.failed and refused.stderr.count("holds a pipeline of 2 stages") == 1
    assert "Resume with 2 ranks" in refused.stderr and "start fresh at 3" in refused.stderr
    assert not epoch_lines(refused.stdout)


@pytest.fixture(scope="module")
def job():
    """jobs/train_pipeline.py as a module (main() does not run), importing job_args as a sibling."""
    sys.path.insert(0, str(Path(JOB).parent))
    try:
        spec = importlib.util.spec_from_file_location("job_train_pipeline", JOB)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(Path(JOB).parent))
    return module


@pytest.mark.parametrize("flag, value, expected", [
    ("--momentum", "1", "expected a finite number >= 0 and < 1 (SGD momentum), got '1'"),
    ("--momentum", "7", "expected a finite number >= 0 and < 1 (SGD momentum), got '7'"),
    ("--lr", "0", "expected a finite number > 0 (the learning rate), got '0'"),
    ("--lr", "-1", "expected a finite number > 0 (the learning rate), got '-1'"),
    ("--max-steps", "-3", "expected an integer >= 0"),
    ("--checkpoint-every", "-5", "expected an integer >= 0"),
], ids=["momentum-1", "momentum-7", "lr-0", "lr-minus-1", "max-steps", "checkpoint-every"])
def test_arguments_refuse_nonsense(job, capsys, flag, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        job.parse_args([flag, value])
    assert exit_info.value.code == 2 and expected in capsys.readouterr().err


def test_help_shows_defaults(job, capsys):
    with pytest.raises(SystemExit):
        job.parse_args(["--help"])
    helped = capsys.readouterr().out
    assert "(default: 0.05)" in helped and "(default: checkpoints-pipeline)" in helped


def test_impossible_runs_are_refused_before_training(launch, tmp_path):
    too_big = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--batch-size",
                      "2000"], nprocs=2, timeout=60)
    assert too_big.failed and too_big.stderr.count("--batch-size 2000 is larger than the 1438") == 1
    missing = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--resume"],
                     nprocs=2, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("--resume: no checkpoint") == 1
    assert not epoch_lines(too_big.stdout + missing.stdout)


def test_pipeline_job_needs_two_ranks(launch):
    result = launch([sys.executable, JOB], nprocs=1, timeout=60)
    assert result.failed and "run with 2 to 4 ranks" in result.output
