"""Issue 26, launched jobs: a pipeline job killed at any phase of a multi-part save resumes from
the newest complete commit and ends as an uninterrupted run; every resume reads through
checkpoint's checks and a damaged checkpoint is one line; the jobs exit like tools (2 for usage,
1 for a checkpoint error, 128 + the signal when stopped, never MPI_Abort's noise for these)."""

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

from hpcgrad import checkpoint, nn
from hpcgrad.comm.mpi import comm_world

pytest.importorskip("sklearn")
ROOT = Path(__file__).resolve().parents[2]
JOBS = {name: str(ROOT / "jobs" / f"{name}.py") for name in ("train_pipeline", "train_ddp",
                                                             "train_resnet")}
KILL = str(ROOT / "tests" / "scripts" / "ckpt26_kill.py")
RUN = ("--no-progress", "--epochs", "1", "--checkpoint-every", "10", "--max-steps", "25")
BOUND = 120  # seconds for any launched job here (each takes a few)


def pipeline(launch, directory, *extra, script=None):
    return launch([sys.executable, script or JOBS["train_pipeline"], *extra, "--checkpoint-dir",
                   str(directory), *RUN], nprocs=2, timeout=BOUND)


def newest_commit(directory):
    """(manifest, {(rank, array name): array}) of the newest commit in ``directory``."""
    name = max(p.name for p in directory.glob("commit-*.json"))
    manifest = json.loads((directory / name).read_text())
    arrays = {}
    for part in manifest["parts"]:
        with np.load(directory / part["file"]) as f:
            arrays.update({(part["rank"], k): f[k] for k in f.files if k != "__meta__"})
    return manifest, arrays


def step_losses(directory):
    """step -> loss from metrics.jsonl, the last record of a step winning (a resumed run's)."""
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}


def assert_same_run(whole, pieces, resumed_at=0):
    """The last commits equal bitwise, and so does every step's loss the resumed run logged
    (a killed run may miss its last step's record: the loss reaches rank 0 a step later)."""
    (a_manifest, a), (b_manifest, b) = newest_commit(whole), newest_commit(pieces)
    assert a_manifest["step"] == b_manifest["step"] == 25
    assert a.keys() == b.keys() and any(name.startswith("optim/") for _, name in a)
    assert not [k for k in a if not np.array_equal(a[k], b[k])]
    expected, logged = step_losses(whole), step_losses(pieces)
    assert set(range(resumed_at + 1, 26)) <= logged.keys()
    assert {s: expected[s] for s in logged} == logged


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted pipeline run of 25 steps (commits at 10, 20, 25), run twice: the job
    is deterministic, which is what lets a resumed run be compared bit for bit."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    first, second = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("again")
    for directory in (first, second):
        done = pipeline(launching.run_job, directory)
        assert not done.failed and "stopped at step 25" in done.stdout, done.output
    assert_same_run(first, second)
    return first


@pytest.mark.parametrize("phase, victim, resumed_at", [
    ("before-parts", 0, 10),
    ("between-parts", 1, 10),
    ("after-parts", 0, 10),
    ("manifest-rename", 0, 10),
    ("after-commit", 0, 20),
])
def test_pipeline_killed_inside_a_save_resumes_from_the_last_commit(launch, tmp_path, whole,
                                                                   phase, victim, resumed_at):
    """Before: stage files at steps 30/30/20 and --resume said 'Start fresh' (the run lost).
    A rank SIGKILLed at each phase of the step-20 save: --resume takes the newest complete
    commit (step 10 unless the manifest was renamed) and ends bit for bit as the whole run."""
    killed = pipeline(launch, tmp_path, script=KILL, *(phase, str(victim), "20"))
    assert not killed.timed_out and killed.returncode != 0, killed.output
    assert "stopped at step" not in killed.stdout
    committed = {json.loads(p.read_text())["step"] for p in tmp_path.glob("commit-*.json")}
    assert max(committed) == resumed_at, (committed, killed.output)
    resumed = pipeline(launch, tmp_path, "--resume")
    assert not resumed.failed, resumed.output
    assert f"commit-0000000{resumed_at // 10}.json: epoch 0, step {resumed_at}" in resumed.stdout
    if phase in ("between-parts", "after-parts", "manifest-rename"):
        assert "ignored the parts of step(s) 20" in resumed.stdout, resumed.stdout
    assert_same_run(whole, tmp_path, resumed_at)


def flip_byte(path, where=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_pipeline_resume_skips_a_damaged_commit_and_says_why(launch, tmp_path, whole):
    pieces = tmp_path / "pieces"
    shutil.copytree(whole, pieces)
    flip_byte(pieces / "part-000000025-1of2.npz")
    resumed = pipeline(launch, pieces, "--resume")
    assert not resumed.failed, resumed.output
    assert ("note: skipped a newer commit, commit-00000003.json (step 25): rank 1: its part "
            "part-000000025-1of2.npz does not match the manifest's sha256") in resumed.stdout
    assert "commit-00000002.json: epoch 0, step 20" in resumed.stdout
    assert_same_run(whole, pieces, 20)


def test_pipeline_with_every_commit_damaged_is_one_line(launch, tmp_path, whole):
    pieces = tmp_path / "pieces"
    shutil.copytree(whole, pieces)
    flip_byte(pieces / "part-000000025-0of2.npz")
    (pieces / "part-000000020-1of2.npz").unlink()
    refused = pipeline(launch, pieces, "--resume")
    assert refused.returncode == 1, refused.output
    line = ("train_pipeline.py: error: no complete multi-part checkpoint in "
            f"'{pieces}': every commit there is damaged")
    assert refused.stderr.count(line) == 1, refused.output
    assert "rank 0: its part part-000000025-0of2.npz does not match" in refused.stderr
    assert "rank 1: its part part-000000020-1of2.npz is missing" in refused.stderr
    assert "Traceback" not in refused.output and "MPI_Abort" not in refused.output


def _truncated(path):
    path.write_bytes(path.read_bytes()[:300])


def _no_meta(path):
    np.savez(path, **{"model/weight": np.zeros(3)})


@pytest.mark.parametrize("job, damage, reason", [
    ("train_resnet", _truncated, "BadZipFile"),
    ("train_resnet", flip_byte, "is unreadable"),
    ("train_resnet", _no_meta, "no '__meta__' entry"),
    ("train_ddp", flip_byte, "is unreadable"),
], ids=["resnet-truncated", "resnet-flipped", "resnet-no-meta", "ddp-flipped"])
def test_damaged_checkpoint_on_resume_is_one_line(launch, tmp_path, job, damage, reason):
    """Before: raw BadZipFile, EOFError or KeyError: '__meta__' tracebacks from every rank (a
    reader outside checkpoint.load). Now checkpoint's checks, said once by rank 0, status 1."""
    path = tmp_path / "last.npz"
    checkpoint.save(path, nn.Linear(64, 64), step=3, epoch=0, batches_done=3, world_size=2)
    damage(path)
    refused = launch([sys.executable, JOBS[job], "--checkpoint-dir", str(tmp_path), "--resume",
                      "--no-progress"], nprocs=2, timeout=BOUND)
    assert refused.returncode == 1, refused.output
    line = f"{job}.py: error: checkpoint '{path}' is "
    assert refused.stderr.count(line) == 1 and reason in refused.stderr, refused.output
    assert "move this one away and start afresh" in refused.stderr
    assert "Traceback" not in refused.output and "MPI_Abort" not in refused.output


@pytest.mark.parametrize("job", sorted(JOBS))
def test_usage_error_is_one_usage_and_status_2(launch, job):
    """Before: the argparse lines from every rank, then MPI_Abort(COMM_WORLD, 2) per rank."""
    bad = launch([sys.executable, JOBS[job], "--batch-size", "0"], nprocs=2, timeout=BOUND)
    assert bad.returncode == 2, bad.output
    assert bad.stderr.count("usage: ") == 1, bad.output
    assert bad.stderr.count(f"{job}.py: error: argument --batch-size: expected an integer >= 1 "
                            "(samples per step), got '0'") == 1, bad.output
    assert "MPI_Abort" not in bad.output and "Traceback" not in bad.output


def test_usage_error_on_one_rank_only_ends_every_rank(launch):
    """Rank 1 alone has a bad argument (an MPMD launch): rank 0 does not wait for it; the
    message (rank 1's) is printed once and every rank exits 2."""
    mpiexec = launching.mpiexec_path()
    job = [sys.executable, JOBS["train_ddp"]]
    argv = [mpiexec, *launching.mpiexec_options(mpiexec)[0], "-n", "1", *job, "--no-progress",
            ":", "-n", "1", *job, "--no-progress", "--lr", "-1"]
    bad = launch(argv, timeout=BOUND)
    assert not bad.timed_out and bad.returncode == 2, bad.output
    assert bad.stderr.count("train_ddp.py: error: argument --lr: expected a finite number > 0 "
                            "(the learning rate), got '-1'") == 1, bad.output
    assert "MPI_Abort" not in bad.output and "hpcgrad DDP job" not in bad.stdout


def stop_with_signal(launch, tmp_path, job, signum, rank=1, *extra):
    """Run ``job`` and send ``signum`` to one rank once it trains; the finished JobResult."""
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(result=launch(
        [sys.executable, JOBS[job], "--checkpoint-dir", str(tmp_path), "--no-progress",
         "--epochs", "20", *extra], nprocs=2, timeout=BOUND)))
    runner.start()
    deadline = time.monotonic() + 60
    pid = rank_pid(JOBS[job], tmp_path, rank, deadline)
    metrics = tmp_path / "metrics.jsonl"
    while time.monotonic() < deadline and not (
            metrics.exists() and metrics.read_text().count('"kind": "step"') >= 3):
        time.sleep(0.02)
    os.kill(pid, signum)
    runner.join(BOUND + 10)
    return outcome["result"]


@pytest.mark.parametrize("job, signum, status", [
    ("train_ddp", signal.SIGTERM, 143),
    ("train_resnet", signal.SIGUSR1, 138),
    ("train_pipeline", signal.SIGTERM, 143),
], ids=["ddp-term", "resnet-usr1", "pipeline-term"])
def test_signal_stops_after_a_checkpoint_with_128_plus_the_signal(launch, tmp_path, job, signum,
                                                                  status):
    """Before: a job stopped by Ctrl-C or preempted exited 0, which SLURM and shells read as
    finished. Now 128 + the signal (as a shell reports a job a signal ended), after the
    checkpoint and PREEMPTED, with one line and no traceback."""
    stopped = stop_with_signal(launch, tmp_path, job, signum)
    assert not stopped.timed_out and stopped.returncode == status, stopped.output
    name = signal.Signals(signum).name
    assert stopped.stdout.count(f"by {name} (exit status {status}); checkpoint ") == 1, \
        stopped.output
    assert "Traceback" not in stopped.output and "MPI_Abort" not in stopped.output
    assert (tmp_path / "PREEMPTED").exists()


@pytest.mark.parametrize("status, preempted, requeued, exit_status", [
    (143, True, True, 0),
    (138, True, True, 0),
    (1, False, False, 1),
    (0, False, False, 0),
], ids=["term", "usr1", "failed", "done"])
def test_sbatch_requeues_on_a_stop_status_only(tmp_path, status, preempted, requeued,
                                               exit_status):
    """slurm/train_ddp.sbatch under `set -e` with stand-ins for srun and scontrol: a run that
    exits 128 + a signal and leaves PREEMPTED is requeued (before, `set -e` ended the script
    at the non-zero status, before the requeue); a failure ends the job with its status."""
    import subprocess
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    checkpoints = tmp_path / "checkpoints"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nmkdir -p \"$CHECKPOINTS\"\n"
        + ("touch \"$CHECKPOINTS/PREEMPTED\"\n" if preempted else "") + f"exit {status}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" > {tmp_path / 'scontrol'}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT),
           "HPCGRAD_VENV": str(Path(sys.executable).parents[1]), "CHECKPOINTS": str(checkpoints),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t", "SLURM_NTASKS": "2",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"}
    done = subprocess.run(["bash", str(ROOT / "slurm" / "train_ddp.sbatch")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == exit_status, done.stdout + done.stderr
    assert ("preempted: requeueing job 4242" in done.stdout) == requeued, done.stdout
    assert (tmp_path / "scontrol").exists() == requeued
    if requeued:
        assert (tmp_path / "scontrol").read_text().split() == ["requeue", "4242"]
