"""jobs/train_gpt.py end to end at tiny sizes: it learns and samples at 2 ranks (ZeRO, activation
checkpointing), stop + --resume equals an uninterrupted run bitwise, 2 ranks equal 1 rank on the
global batch, and nonsense flags are refused before any rank starts."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from launching import run_job

from hpcgrad.comm.mpi import comm_world

JOBS = Path(__file__).resolve().parents[2] / "jobs"
JOB = str(JOBS / "train_gpt.py")
# 12 steps of a 2-layer, d-32 model on 16-byte windows of 100 KiB of text: about 1 s of training.
TINY = ("--d-model", "32", "--heads", "2", "--layers", "2", "--block-size", "16",
        "--epochs", "2", "--steps-per-epoch", "6", "--warmup", "2", "--lr", "1e-2",
        "--corpus-mb", "0.1", "--val-windows", "16", "--sample-bytes", "40", "--no-progress")
PATHS = ("--zero", "--checkpoint-activations")


def train(launch, checkpoint_dir, *args, nprocs=2):
    result = launch([sys.executable, JOB, "--checkpoint-dir", str(checkpoint_dir), *TINY, *args],
                    nprocs=nprocs, timeout=120)
    assert not result.failed, result.output
    return result


def arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k != "__meta__"}


def step_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"], [r for r in records
                                                                  if r["kind"] == "epoch"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted 2-rank run (--zero --checkpoint-activations, global batch 8) that the
    tests below compare with: one launch for all of them."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    run_dir = tmp_path_factory.mktemp("gpt") / "whole"
    return run_dir, train(run_job, run_dir, "--batch-size", "4", *PATHS)


def test_two_ranks_learn_and_print_a_sample(whole):
    run_dir, done = whole
    assert "hpcgrad GPT job: 2 ranks" in done.stdout and "ZeRO over AdamW" in done.stdout
    assert "activation checkpointing" in done.stdout and "ranks: 0 " in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and "step 12" in lines[-1] and "tokens/s" in lines[-1]
    assert "val accuracy" in lines[-1]
    losses, epochs = step_losses(run_dir)
    assert len(losses) == 12 and len(epochs) == 2
    # Seeded: 5.5 -> 3.3 per step (ln 256 = 5.55 at the start), validation 4.0 -> 3.2.
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert epochs[-1]["test_loss"] < epochs[0]["test_loss"]
    assert 0 < epochs[-1]["test_accuracy"] < 1 and epochs[-1]["tokens_per_s"] > 0
    assert done.stdout.count("sample (40 bytes after 'def '") == 1
    assert done.stdout.split("temperature 0.8):\n")[1].startswith("def ")
    assert not (run_dir / "PREEMPTED").exists()


def test_stop_and_resume_matches_the_uninterrupted_run(whole, launch, tmp_path):
    """Stopped mid-epoch (step 5 of 6), the run resumes with the ZeRO shards, AdamW's step
    counts and moments, the warm-up + cosine schedule and the step counter, and draws the same
    windows (a function of seed and step): it ends bit for bit where the whole run did."""
    run_dir, _ = whole
    stopped = train(launch, tmp_path, "--batch-size", "4", *PATHS, "--max-steps", "5")
    assert "stopped at step 5" in stopped.stdout and "sample (" not in stopped.stdout
    assert not (tmp_path / "PREEMPTED").exists()  # --max-steps is not a preemption
    resumed = train(launch, tmp_path, "--batch-size", "4", *PATHS, "--resume")
    assert "resumed from" in resumed.stdout and "epoch 0, step 5" in resumed.stdout
    assert "(steps 6-6 only: resumed)" in resumed.stdout
    a, b = arrays(run_dir / "last.npz"), arrays(tmp_path / "last.npz")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []
    # Every step is logged once (read_metrics keeps the resumed run's line for a redone step).
    assert step_losses(tmp_path)[0] == step_losses(run_dir)[0]


def test_two_ranks_equal_one_rank_on_the_global_batch(whole, launch, tmp_path):
    """One rank of --batch-size 8 draws the same 8 windows per step as two ranks of 4 (rank r
    takes slice r), and the two ranks' mean of means is the one rank's mean; only the order of
    the float32 sums differs (two half-batch matmuls and an all-reduce against one), so the
    parameters and moments agree to rounding, not bitwise. The loosest is the attention's key
    bias: its gradient is zero in exact arithmetic (softmax ignores a constant added to a row of
    scores), so it is rounding noise, which AdamW scales up to about lr * g / (|g| + eps): seen
    5.3e-6 apart after 12 steps, hence atol 2e-5 (everything else is within 2e-6)."""
    run_dir, _ = whole
    train(launch, tmp_path, "--batch-size", "8", *PATHS, nprocs=1)
    a, b = arrays(run_dir / "last.npz"), arrays(tmp_path / "last.npz")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=2e-5, err_msg=k)


def load_job(name):
    """jobs/<name>.py as a module (its main() does not run), importing job_args as a sibling."""
    if str(JOBS) not in sys.path:
        sys.path.insert(0, str(JOBS))
    spec = importlib.util.spec_from_file_location(f"job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3"], "--heads 3 does not divide --d-model 128; pass a d-model that is a "
                       "multiple of it (for example 129)"),
    (["--block-size", "100000", "--corpus-mb", "0.1"],
     "--block-size 100000 needs windows of 100001 bytes, but the training text is "),
    (["--block-size", "20000", "--corpus-mb", "0.1"],
     "bytes, but the validation text is 10,485 bytes (--corpus-mb 0.1, --val-fraction 0.1)"),
    (["--warmup", "300"], "--warmup 300 leaves no steps to decay over: the run has 300"),
    (["--val-fraction", "1"], "--val-fraction: expected a finite number > 0 and < 1"),
    (["--d-model", "0"], "--d-model: expected an integer >= 1 (the width of the residual "
                         "stream), got '0'"),
])
def test_nonsense_flags_are_refused_in_one_line(capsys, argv, message):
    job = load_job("train_gpt")
    with pytest.raises(SystemExit) as exit_info:
        job.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_a_resume_that_would_be_another_run_is_refused(capsys):
    """Another global batch, model or corpus cannot continue the run exactly: the job says
    which and what to pass; the same global batch at another number of ranks can."""
    job = load_job("train_gpt")
    args = job.parse_args(["--batch-size", "8"])
    saved = {"world_size": 2, "args": {**vars(args), "batch_size": 8}, "corpus_sha256": "abc"}
    assert "a global batch of 16 windows; this run has 8 (1 ranks x --batch-size 8); resume " \
           "with --batch-size 16" in job.resume_problem(saved, "p", 1, args, "abc")
    assert job.resume_problem(saved, "p", 2, args, "abc") is None
    args.batch_size = 16  # one rank of 16 takes the two ranks' steps (window_starts)
    assert job.resume_problem(saved, "p", 1, args, "abc") is None
    args.d_model = 64
    assert "was saved with --d-model 128, this run has 64" in job.resume_problem(
        saved, "p", 1, args, "abc")
    args.d_model = 128
    assert "another corpus" in job.resume_problem(saved, "p", 1, args, "xyz")
