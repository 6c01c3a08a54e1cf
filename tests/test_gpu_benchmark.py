"""benchmarks/gpu.py without a GPU: "no GPU" and exit 0, and its --cpu dry run of every step at 1 and 2 ranks."""

import re
import sys
from pathlib import Path

import pytest

from hpcgrad.info import gpu_count

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu.py"
CASES = ("MLP 784-1024-1024-10", "CNN 1x28x28 (conv8-pool-conv16-pool-fc)")


def has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is here: the script would measure it")
def test_without_gpu_it_says_so(launch):
    job = launch([sys.executable, str(SCRIPT), "--quick"], timeout=120)
    assert not job.failed, job.output
    assert job.stdout.startswith("no GPU: "), job.output
    assert "kernel" not in job.stdout and "DDP" not in job.stdout


def check_dry_run(output, ranks, with_torch):
    """Every figure line tests/gpu.sh's report copies is there, once, with the expected parts."""
    lines = output.splitlines()
    kernel = [line for line in lines if line.startswith("kernel scaled_copy 1 MB (CPU dry run)")]
    assert len(kernel) == 1, output
    assert re.search(r"ratio \d+\.\d\d \(target >= 0\.8\)", kernel[0]), kernel[0]
    reduce = [line for line in lines if line.startswith("all-reduce 1 MB")]
    assert len(reduce) == 1 and f"at {ranks} rank(s), host arrays" in reduce[0], output
    ddp = [line for line in lines if line.startswith("DDP step")]
    assert [line.split(",")[0] for line in ddp] == [f"DDP step {case}" for case in CASES], output
    for line in ddp:
        assert f"batch 4/rank, {ranks} rank(s) (CPU dry run): hpcgrad " in line, line
        if with_torch:
            assert "torch DDP (gloo)" in line and re.search(r"ratio \d+\.\d\dx", line), line
        else:
            assert "torch DDP: skipped" in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2])
def test_dry_run_measures_every_piece(launch, ranks):
    """Kernel, all-reduce and both models' DDP steps (with torch DDP over gloo when torch is
    installed), run on the host: the same code as on a GPU but for the device's calls."""
    with_torch = has_torch()
    argv = [sys.executable, str(SCRIPT), "--cpu", "--quick", "--megabytes", "1", "--batch", "4"]
    if not with_torch:
        argv.append("--no-torch")
    job = launch(argv, nprocs=ranks, timeout=240)
    assert not job.failed, job.output
    check_dry_run(job.stdout, ranks, with_torch)
