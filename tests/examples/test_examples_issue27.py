"""The examples/ ports of pytorch/examples run at tiny sizes (issue 27), beside PyTorch where installed.

Each port runs as its header's command says (plain python where mp.spawn starts the ranks,
Note [spawn over MPI]; mpiexec where torchrun or mp.Process did), on a copy in a
temporary folder with two kinds of test-only edits, both listed here or in tools/examples_diff.py:
the GPU tutorials' device lines point at the CPU (Note [CPU runs of GPU examples]), and where a
script has no option for fewer steps, TINY shrinks its size constants (offline_mnist's
OFFLINE_MNIST_SIZE plays that part for the MNIST scripts).

Losses are compared with PyTorch's statistically, not digit for digit: hpcgrad's generator
(numpy's PCG64) is not PyTorch's (mt19937), so initial weights, dropout masks and the synthetic
data differ. What is comparable is the first logged loss of a freshly initialised 10-class
classifier, ln(10) = 2.303 give or take what random weights add: both libraries' first loss must
lie within 0.15 of ln(10) and of each other (measured: 2.306 here, 2.281 PyTorch), and where a
script logs several losses the later one must be lower.
"""

import math
import re
import shutil
import sys
from pathlib import Path

import pytest

import launching

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT / "tools"))
import examples_diff  # noqa: E402

# Test-only size edits for scripts whose sizes are constants (no option, no variable).
TINY = {
    "distributed/rpc/ddp_rpc/main.py": [("for epoch in range(100):", "for epoch in range(2):")],
    "distributed/rpc/batch/parameter_server.py": [
        ("batch_size = 20", "batch_size = 2"), ("image_w = 64", "image_w = 32"),
        ("image_h = 64", "image_h = 32"), ("batch_update_size = 5", "batch_update_size = 1"),
        ("num_batches = 6", "num_batches = 1")],
    "distributed/rpc/batch/reinforce.py": [("NUM_STEPS = 500", "NUM_STEPS = 50")],
    "distributed/rpc/rl/main.py": [
        ("if agent.running_reward > agent.reward_threshold:", "if i_episode >= 2:")],
    "distributed/rpc/pipeline/main.py": [
        ("num_batches = 3", "num_batches = 1"), ("batch_size = 120", "batch_size = 2"),
        ("image_w = 128", "image_w = 16"), ("image_h = 128", "image_h = 16"),
        ("for num_split in [1, 2, 4, 8]:", "for num_split in [2]:")],
}
LN10 = math.log(10.0)


def _prepare(relative, folder, torch_twin=False):
    """Copy the port's folder to ``folder`` (links resolved), its scripts CPU-edited and shrunk."""
    source_dir = (EXAMPLES / relative).parent
    for path in source_dir.iterdir():
        if path.suffix != ".py":
            continue
        text = path.read_text()
        if path.resolve().parent == source_dir and not path.is_symlink():
            name = str(Path(relative).parent / path.name)
            if name in examples_diff.GPU_ONLY:
                text, _ = examples_diff.cpu_variant(text)
            for old, new in TINY.get(name, ()):
                assert old in text, f"{path.name}: TINY edit {old!r} no longer matches"
                text = text.replace(old, new)
            if torch_twin:
                text = examples_diff.torch_twin(text)
        (folder / path.name).write_text(text)
    return folder / Path(relative).name


def _run(relative, tmp_path, args=(), nprocs=None, env=None, timeout=120):
    """Run the port (under mpiexec -n nprocs, else plain python: a spawn starts its own mpiexec,
    bounded by MPIEXEC_TIMEOUT as well as by run_job's timeout)."""
    script = _prepare(relative, tmp_path)
    env = {"PYTHONPATH": str(tmp_path), "MPIEXEC_TIMEOUT": str(timeout), **(env or {})}
    job = launching.run_job([sys.executable, str(script), *args], nprocs=nprocs, env=env,
                            timeout=timeout)
    assert not job.failed, f"{relative} failed ({job.returncode}):\n{job.output[-3000:]}"
    return job.stdout


def _cwd_run(relative, tmp_path, args=(), nprocs=None, timeout=120):
    """As _run, in ``tmp_path`` as the working folder (scripts that write checkpoints there)."""
    script = _prepare(relative, tmp_path)
    argv = [sys.executable, "-c", f"import os, runpy, sys; os.chdir({str(tmp_path)!r}); "
            f"sys.argv = [{str(script)!r}, *{list(args)!r}]; sys.path.insert(0, {str(tmp_path)!r}); "
            f"runpy.run_path({str(script)!r}, run_name='__main__')"]
    job = launching.run_job(argv, nprocs=nprocs, timeout=timeout)
    assert not job.failed, f"{relative} failed ({job.returncode}):\n{job.output[-3000:]}"
    return job.stdout


def _losses(text, pattern):
    return [float(m) for m in re.findall(pattern, text)]


def test_mnist_first_loss_is_pytorchs(tmp_path):
    pytest.importorskip("sklearn")
    args = ("--epochs", "1", "--dry-run", "--batch-size", "16", "--test-batch-size", "16")
    env = {"OFFLINE_MNIST_SIZE": "16"}  # one step, one test batch
    ours = _losses(_run("mnist/main.py", tmp_path, args, env=env), r"Loss: ([\d.]+)")
    assert len(ours) == 1 and abs(ours[0] - LN10) < 0.15, ours
    torch = pytest.importorskip("torch")  # noqa: F841
    twin = tmp_path / "torch"
    twin.mkdir()
    script = _prepare("mnist/main.py", twin, torch_twin=True)
    job = launching.run_job([sys.executable, str(script), *args], env=env, timeout=120)
    assert not job.failed, job.output[-3000:]
    theirs = _losses(job.stdout, r"Loss: ([\d.]+)")
    assert abs(theirs[0] - LN10) < 0.15 and abs(ours[0] - theirs[0]) < 0.15, (ours, theirs)


def test_ddp_tutorial_trains_and_resumes_from_its_snapshot(tmp_path):
    out = _cwd_run("distributed/ddp-tutorial-series/single_gpu.py", tmp_path, ("1", "1"))
    assert "[GPUcpu] Epoch 0 | Batchsize: 32 | Steps: 64" in out
    assert (tmp_path / "checkpoint.pt").exists()
    out = _cwd_run("distributed/ddp-tutorial-series/multinode.py", tmp_path, ("1", "1"), nprocs=2)
    # The same lines torchrun --nproc-per-node 2 prints with PyTorch (2048 samples, 2 ranks).
    assert "[GPU0] Epoch 0 | Batchsize: 32 | Steps: 32" in out
    assert "[GPU1] Epoch 0 | Batchsize: 32 | Steps: 32" in out
    assert "Epoch 0 | Training snapshot saved at snapshot.pt" in out
    out = _cwd_run("distributed/ddp-tutorial-series/multinode.py", tmp_path, ("2", "1"), nprocs=2)
    # EPOCHS_RUN holds the last epoch saved, so upstream resumes by running that epoch again.
    assert "Resuming training from snapshot at Epoch 0" in out
    assert "[GPU1] Epoch 1 | Batchsize: 32 | Steps: 32" in out


def test_rpc_parameter_server_loss_decreases(tmp_path):
    pytest.importorskip("sklearn")
    out = _run("distributed/rpc/parameter_server/rpc_parameter_server.py", tmp_path,
               ("--world_size", "2"), nprocs=2, env={"OFFLINE_MNIST_SIZE": "192"})
    losses = _losses(out, r"training batch \d+ loss ([\d.]+)")
    assert len(losses) == 2 and abs(losses[0] - LN10) < 0.15 and losses[1] < losses[0], losses
    assert re.search(r"Accuracy [\d.]+", out)


def test_rpc_ddp_rpc_trains(tmp_path):
    out = _run("distributed/rpc/ddp_rpc/main.py", tmp_path)
    assert out.count("Training done for epoch 1") == 2
    assert out.count("Distributed RPC example completed successfully.") == 1  # the parent, as PyTorch


def test_rpc_batch_parameter_server_updates(tmp_path):
    out = _run("distributed/rpc/batch/parameter_server.py", tmp_path)
    assert out.count("PS updated model") == 1 and "Finish training" in out


def test_rpc_batch_reinforce_runs_batched_and_not(tmp_path):
    out = _run("distributed/rpc/batch/reinforce.py", tmp_path, ("--num-episode", "1"))
    assert len(re.findall(r"Episode 0\tLast reward: [\d.]+\tAverage reward", out)) == 2


def test_rpc_rl_runs_episodes(tmp_path):
    out = _run("distributed/rpc/rl/main.py", tmp_path, ("--log-interval", "1"))
    assert re.search(r"Episode 2\tLast reward: [\d.]+\tAverage reward", out)


def test_ddp_example_trains(tmp_path):
    # torchrun also sets MASTER_ADDR/MASTER_PORT, which this script reads (and prints); under
    # mpiexec hpcgrad sets placeholders where they are absent (Note [torchrun's variables]).
    out = _run("distributed/ddp/example.py", tmp_path, nprocs=2)
    assert "training completed in rank 0!" in out and "training completed in rank 1!" in out


def test_rpc_rnn_trains(tmp_path):
    out = _run("distributed/rpc/rnn/main.py", tmp_path)
    assert "Training epoch 9" in out


def test_rpc_pipeline_trains(tmp_path):
    out = _run("distributed/rpc/pipeline/main.py", tmp_path)
    assert "Processing batch 0" in out and "number of splits = 2" in out


def test_readme_gives_the_computed_line_counts():
    table = (EXAMPLES / "README.rst").read_text()
    for relative in examples_diff.ported_files():
        n, _, _ = examples_diff.count(relative)
        edits = "-"
        if str(relative) in examples_diff.GPU_ONLY:
            edits = examples_diff.cpu_variant((EXAMPLES / relative).read_text())[1]
        row = next((line for line in table.splitlines() if f"``{relative}``" in line), None)
        assert row is not None, f"examples/README.rst has no row for {relative}"
        assert re.search(rf"\|\s*{n}\s*\|\s*{edits}\s*\|", row), \
            f"{relative}: README row {row!r}, computed {n} lines and {edits} CPU edits"
