"""jobs/train_resnet.py end to end: it learns with PowerSGD, 2 ranks equal 1 rank on the full
batch (SyncBatchNorm, ZeRO), and stop + --resume equals an uninterrupted run bitwise."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "train_resnet.py")
POWERSGD = ("--powersgd", "2", "--powersgd-start", "5")


def train(launch, checkpoint_dir, *args, nprocs=2):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(checkpoint_dir), "--no-progress",
                     *args], nprocs=nprocs, timeout=120)
    assert not result.failed, result.output
    return result


def arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k != "__meta__"}


def epoch_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("epoch ")]


def field(line, name):
    return float(line.split(name)[1].split()[0])


def test_stop_and_resume_with_powersgd_matches_uninterrupted_run(launch, tmp_path):
    """The uninterrupted run also shows that it learns (loss falls, accuracy far above 0.1)
    and reports PowerSGD's bytes; the resumed one restores the ZeRO shards, OneCycleLR and
    every rank's PowerSGD error and warm-start memory, so the two end bit for bit equal."""
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    done = train(launch, whole, "--epochs", "2", *POWERSGD)
    assert "ranks: 0 " in done.stdout and "SyncBatchNorm; ZeRO" in done.stdout
    lines = epoch_lines(done.stdout)
    assert len(lines) == 2 and "sent 8,640 of 78,824 bytes/step" in lines[-1]
    assert field(lines[-1], "loss") < field(lines[0], "loss")
    assert field(lines[-1], "test accuracy") > 0.5, done.stdout  # seeded: 0.67 (0.99 at 6 epochs)
    stopped = train(launch, pieces, "--epochs", "2", "--max-steps", "30", *POWERSGD)
    assert "stopped at step 30" in stopped.stdout
    resumed = train(launch, pieces, "--epochs", "2", "--resume", *POWERSGD)
    assert "resumed from" in resumed.stdout and "epoch 1, step 30" in resumed.stdout
    a, b = arrays(whole / "last.npz"), arrays(pieces / "last.npz")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    assert all(np.array_equal(a[k], b[k]) for k in a), [k for k in a if not np.array_equal(a[k], b[k])]
    refused = launch([sys.executable, JOB, "--checkpoint-dir", str(pieces), "--resume",
                      "--epochs", "2", "--width", "8", *POWERSGD], nprocs=2, timeout=60)
    assert refused.failed and refused.stderr.count("was saved with --width 16, this run has 8") == 1


def test_two_ranks_equal_one_rank_on_the_full_batch(launch, tmp_path):
    """Each 2-rank step's two shards are the 1-rank step's batch, SyncBatchNorm normalizes
    with the global batch's statistics and ZeRO steps as plain SGD: parameters, BN running
    statistics and the consolidated momentum agree up to float32 rounding."""
    steps = ("--epochs", "2", "--max-steps", "8")
    train(launch, tmp_path / "one", *steps, "--batch-size", "64", nprocs=1)
    train(launch, tmp_path / "two", *steps, "--batch-size", "32")
    a, b = arrays(tmp_path / "one" / "last.npz"), arrays(tmp_path / "two" / "last.npz")
    assert a.keys() == b.keys() and len([k for k in a if k.startswith("optim/")]) == 20
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_resnet18_arch_trains_on_upscaled_digits_and_refuses_a_mismatched_resume(launch, tmp_path):
    """--arch resnet18 (here at width 4, one rank): the 3x32x32 digits go through the whole
    ResNet-18 (its 20 convolutions, strided and 1x1 ones among them); over 20 steps the loss
    falls (the last five's mean below 0.85 of the first five's). Seen 2.3 -> 1.4 with numpy's
    BatchNorm and 2.3 -> 1.77 with the numba passes: the two differ by rounding (3e-6 of the
    first step's gradients), which 20 steps at lr 0.1 of a width-4 network amplify; a
    network that does not learn stays near ln 10 = 2.3. A
    --resume with the small model is refused in one line, as another --width is."""
    steps = ("--arch", "resnet18", "--width", "4", "--epochs", "1", "--max-steps", "20",
             "--batch-size", "32", "--lr", "0.1")
    result = train(launch, tmp_path / "r18", *steps, nprocs=1)
    assert "resnet18, width 4" in result.output
    saved = arrays(tmp_path / "r18" / "last.npz")
    convs = [k for k in saved if k.startswith("model/") and saved[k].ndim == 4]
    assert len(convs) == 20 and saved[convs[0]].shape == (4, 3, 3, 3)
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "r18" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "step"]
    assert len(losses) == 20 and np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5])
    again = launch([sys.executable, JOB, "--checkpoint-dir", str(tmp_path / "r18"), "--no-progress",
                    "--resume", "--epochs", "1"], nprocs=1, timeout=120)
    assert again.returncode == 2 and "--arch resnet18, this run has small" in again.output


def test_synthetic_data_needs_the_resnet18_arch(launch, tmp_path):
    result = launch([sys.executable, JOB, "--data", "synthetic", "--checkpoint-dir",
                     str(tmp_path)], nprocs=1, timeout=120)
    assert result.returncode == 2
    assert "--data synthetic makes 3x32x32 images: use it with --arch resnet18" in result.output
