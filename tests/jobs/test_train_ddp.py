"""jobs/train_ddp.py end to end: it learns, and stop + --resume equals an uninterrupted run bitwise."""

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "train_ddp.py")


def train(launch, checkpoint_dir, *args):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(checkpoint_dir), "--no-progress",
                     *args], nprocs=2, timeout=120)
    assert not result.failed, result.output
    return result


def model_arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("model/")}


def test_ddp_job_learns_digits(launch, tmp_path):
    result = train(launch, tmp_path, "--epochs", "6")
    accuracy = float(result.stdout.strip().splitlines()[-1].split("test accuracy")[1].split()[0])
    assert accuracy > 0.9, result.stdout  # seeded run: ~0.95-0.98


def test_stop_and_resume_matches_uninterrupted_run(launch, tmp_path):
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    train(launch, whole, "--epochs", "2")
    stopped = train(launch, pieces, "--epochs", "2", "--max-steps", "30")
    assert "stopped at step 30" in stopped.stdout
    resumed = train(launch, pieces, "--epochs", "2", "--resume")
    assert "resumed from" in resumed.stdout and "epoch 1, step 30" in resumed.stdout
    a, b = model_arrays(whole / "last.npz"), model_arrays(pieces / "last.npz")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_without_checkpoint_says_how_to_fix(launch, tmp_path):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path), "--resume"],
                    nprocs=2, timeout=60)
    assert result.failed and "no checkpoint at" in result.output
