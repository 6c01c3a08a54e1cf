"""The jobs' command lines refuse nonsense with an argparse error (exit 2) that says what was
expected, what came and what to pass, before any rank starts training."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def load_job(name):
    """jobs/<name>.py as a module (its main() does not run): the jobs import job_args as a
    sibling, as when run as a script."""
    if str(JOBS) not in sys.path:
        sys.path.insert(0, str(JOBS))
    spec = importlib.util.spec_from_file_location(f"job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_ddp():
    return load_job("train_ddp")


@pytest.fixture(scope="module")
def train_pipeline():
    return load_job("train_pipeline")


def refused(job, capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        job.parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], (r"--seed: expected an integer >= 0 \(the random seed\), got '-1'; "
                        r"for example 0")),
    (["--seed", "1.5"], r"--seed: expected an integer >= 0 .*got '1.5'"),
    (["--bucket-cap-mb", "nan"], (r"--bucket-cap-mb: expected a finite number > 0 \(DDP's "
                                  r"bucket size in MB\), got 'nan'; for example 25")),
    (["--bucket-cap-mb", "0"], r"--bucket-cap-mb: expected a finite number > 0 .*got '0'"),
    (["--bucket-cap-mb", "-1"], r"--bucket-cap-mb: expected a finite number > 0 .*got '-1'"),
    (["--bucket-cap-mb", "inf"], r"--bucket-cap-mb: .*got 'inf'"),
    (["--epochs", "0"], r"--epochs: expected an integer >= 1 .*got '0'"),
    (["--batch-size", "-4"], r"--batch-size: expected an integer >= 1 .*got '-4'"),
    (["--lr", "nan"], r"--lr: expected a finite number > 0 .*got 'nan'"),
    (["--lr", "-0.1"], r"--lr: expected a finite number > 0 .*got '-0.1'"),
    (["--momentum", "inf"], r"--momentum: expected a finite number >= 0 .*got 'inf'"),
    (["--checkpoint-every", "-5"], r"--checkpoint-every: expected an integer >= 0 .*got '-5'"),
    (["--max-steps", "-1"], r"--max-steps: expected an integer >= 0 .*got '-1'"),
    (["--checkpoint-dir", ""], r"--checkpoint-dir: expected a directory path, got ''"),
])
def test_train_ddp_refuses_nonsense(train_ddp, capsys, argv, message):
    assert re.search(message, refused(train_ddp, capsys, *argv))


def test_train_ddp_refuses_a_file_as_checkpoint_dir(train_ddp, capsys, tmp_path):
    """Found before training, not by rank 0 alone at its first save (the others would wait
    at the barrier)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    err = refused(train_ddp, capsys, "--checkpoint-dir", str(a_file))
    assert f"expected a directory, got '{a_file}', which is a file" in err


def test_train_ddp_accepts_sensible_values(train_ddp, tmp_path):
    args = train_ddp.parse_args(["--seed", "7", "--bucket-cap-mb", "0.001", "--lr", "0.001",
                                 "--checkpoint-dir", str(tmp_path / "new"), "--max-steps", "0"])
    assert (args.seed, args.bucket_cap_mb, args.lr, args.max_steps) == (7, 0.001, 0.001, 0)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], r"--seed: expected an integer >= 0 .*got '-1'"),
    (["--timeout", "0"], r"--timeout: expected a finite number > 0 .*got '0'"),
    (["--timeout", "nan"], r"--timeout: expected a finite number > 0 .*got 'nan'"),
    (["--epochs", "x"], r"--epochs: expected an integer >= 1 .*got 'x'"),
    (["--lr", "-1"], r"--lr: expected a finite number > 0 .*got '-1'"),
])
def test_train_pipeline_refuses_nonsense(train_pipeline, capsys, argv, message):
    assert re.search(message, refused(train_pipeline, capsys, *argv))


def test_seed_minus_one_as_a_user_runs_it():
    """End to end, as a user types it: exit 2 and the message, no numpy traceback."""
    result = subprocess.run([sys.executable, str(JOBS / "train_ddp.py"), "--seed", "-1"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "argument --seed: expected an integer >= 0" in result.stderr
    assert "Traceback" not in result.stderr
