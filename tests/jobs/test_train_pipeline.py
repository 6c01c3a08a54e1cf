"""jobs/train_pipeline.py end to end: a model split across 2 and 3 ranks learns digits, rank 0 reports."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "train_pipeline.py")


@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_job_learns_digits(launch, ranks):
    result = launch([sys.executable, JOB, "--epochs", "3"], nprocs=ranks, timeout=90)
    assert not result.failed, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"pipeline of {ranks} stages"), result.stdout
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split()[1] for line in epochs] == ["1/3", "2/3", "3/3"], result.stdout
    accuracy = float(epochs[-1].split("test accuracy")[1].split()[0])
    assert accuracy > 0.85, result.stdout  # seeded run: ~0.92-0.94


def test_pipeline_job_needs_two_ranks(launch):
    result = launch([sys.executable, JOB], nprocs=1, timeout=60)
    assert result.failed and "run with 2 to 4 ranks" in result.output
