"""jobs/train_ddp.py --elastic: a 4-rank job loses a rank and finishes on 3, equal bit for bit to
a run whose ranks leave by plan at the same step; below --min-ranks it checkpoints, exits 75 and
resumes on fewer ranks (tests/elastic/scripts/job_fault.py, under ULFM)."""

import json
import re
import sys

import numpy as np
import pytest

from elastic_jobs import ROOT, run_ft_job
from launching import run_job

JOB = ROOT / "jobs" / "train_ddp.py"
ARGS = ("--elastic", "--epochs", "2", "--no-progress", "--commit-every", "5")
FAULT_STEP, RESTORED = 8, 5  # the fault comes at step 8; the newest commit is step 5's


def _fault_run(tmp_path, name, mode, rank, *extra):
    out = tmp_path / name
    job = run_ft_job("job_fault.py", 4, [*ARGS, "--checkpoint-dir", out, *extra], timeout=90,
                     env={"JOB_FAULT": f"{mode} {rank} {FAULT_STEP}"})
    assert not job.timed_out, job.output[-3000:]
    assert (out / "exit_status").exists(), f"{name}: the job did not end:\n{job.output[-3000:]}"
    return out, job.stdout


def _weights(out):
    with np.load(out / "last.npz") as saved:
        return {k: saved[k] for k in saved.files if k.startswith(("model/", "optim/"))}


def _assert_equal(out, reference):
    mine, theirs = _weights(out), _weights(reference)
    assert mine.keys() == theirs.keys() and mine
    different = [k for k in mine if not np.array_equal(mine[k], theirs[k])]
    assert not different, f"{out.name} differs from {reference.name} in {different}"


def _epoch_lines(text):
    return re.findall(r"^epoch (\d)/2  step (\d+)  loss (\S+) .*test accuracy (\S+)", text,
                      re.MULTILINE)


@pytest.mark.slow
@pytest.mark.timeout(240)  # two 4-rank jobs of ~5-20 s each on a loaded 2-core machine
# (os._exit of rank 1 is in test_shrink.py: here rank 0, whose roles the loop hands over)
@pytest.mark.parametrize("mode,rank", [("kill9", 0)], ids=["sigkill-rank0"])
def test_job_goes_on_without_a_lost_rank(tmp_path, mode, rank):
    """The survivors say the world changed and finish both epochs; the new rank 0 (rank 0 was
    killed) writes the epoch lines, metrics.jsonl, the checkpoint and exit_status 0."""
    out, text = _fault_run(tmp_path, "lost", mode, rank)
    assert (f"world changed: 4 -> 3 ranks (lost world rank(s) {rank}); going on from step "
            f"{RESTORED}") in text, text[-3000:]
    lines = _epoch_lines(text)
    assert [line[0] for line in lines] == ["1", "2"], text[-3000:]
    assert (out / "exit_status").read_text() == "0\n"
    assert not (out / "PREEMPTED").exists()
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"epoch", "step"' in line]
    assert [e["epoch"] for e in epochs] == [1, 2]
    reference, reference_text = _fault_run(tmp_path, "leave", "leave", rank)
    _assert_equal(out, reference)
    assert _epoch_lines(reference_text) == lines  # the same losses and accuracies, printed


GPT = ("--d-model", "32", "--heads", "2", "--layers", "2", "--block-size", "16", "--epochs", "2",
       "--steps-per-epoch", "8", "--warmup", "2", "--lr", "1e-2", "--corpus-mb", "0.1",
       "--val-windows", "16", "--sample-bytes", "40", "--no-progress", "--elastic",
       "--commit-every", "3")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_job_goes_on_without_rank_0(tmp_path):
    """jobs/train_gpt.py --elastic (no sampler: the step number draws the windows, and the
    scheduler rides in the commit): rank 0 killed at step 11 of 16, the survivors go back to
    step 9's commit and end equal bit for bit to rank 0 leaving by plan there; the new rank 0
    prints the sample."""
    runs = {}
    for mode in ("kill9", "leave"):
        out = tmp_path / mode
        job = run_ft_job("job_fault.py", 4, [*GPT, "--checkpoint-dir", out], timeout=150,
                         env={"JOB_FAULT": f"{mode} 0 11", "JOB_FAULT_PROGRAM": "train_gpt.py"})
        assert not job.timed_out and (out / "exit_status").exists(), job.output[-3000:]
        assert "world changed: 4 -> 3 ranks (lost world rank(s) 0); going on from step 9" in \
            job.stdout, job.output[-3000:]
        assert "sample (40 bytes after 'def '" in job.stdout, job.output[-3000:]
        runs[mode] = out
    _assert_equal(runs["kill9"], runs["leave"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_below_min_ranks_the_job_checkpoints_and_resumes_on_fewer(tmp_path):
    """--min-ranks 4 and a lost rank: checkpoint of the restored commit, PREEMPTED, exit status
    75 (in exit_status: mpirun's own is the dead rank's); --resume on 3 ranks then ends where a
    run that went on at once ends, bit for bit."""
    out, text = _fault_run(tmp_path, "small", "exit", 2, "--min-ranks", "4")
    assert "below --min-ranks 4" in text and "exit status 75" in text, text[-3000:]
    assert (out / "exit_status").read_text() == "75\n"
    assert (out / "PREEMPTED").exists()
    with np.load(out / "last.npz") as saved:
        meta = json.loads(saved["__meta__"].tobytes().decode())
    assert meta["extra"]["step"] == RESTORED, meta
    job = run_job([sys.executable, str(JOB), *ARGS, "--checkpoint-dir", str(out), "--resume"],
                  nprocs=3, timeout=90)
    assert job.returncode == 0, job.output[-3000:]
    assert f"resumed from {out / 'last.npz'}: epoch 0, step {RESTORED}" in job.stdout
    assert not (out / "PREEMPTED").exists()
    reference, _ = _fault_run(tmp_path, "leave", "leave", 2)
    _assert_equal(out, reference)
