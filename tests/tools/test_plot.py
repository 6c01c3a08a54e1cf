"""python -m hpcgrad.plot RUN_DIR draws a real PNG of the run's curves."""

import struct
import subprocess
import sys

import numpy as np
import pytest

from hpcgrad.training.metrics import MetricsLog

pyplot = pytest.importorskip("matplotlib.pyplot", reason="the plot extra (matplotlib) is not installed")


def _png_size(path):
    """(width, height) from the PNG header, read independently of matplotlib."""
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", header[16:24])


def test_plot_writes_a_png_of_the_curves(tmp_path):
    with MetricsLog(tmp_path) as log:
        for step in range(1, 41):
            log.write("step", step, step // 10, step * 0.1, loss=2.0 / step)
            if step % 10 == 0:
                log.write("epoch", step, step // 10, step * 0.1, loss=2.0 / step,
                          test_accuracy=0.5 + step / 100, samples_per_s=1000.0 + step)
    done = subprocess.run([sys.executable, "-m", "hpcgrad.plot", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    png = tmp_path / "metrics.png"
    assert done.stdout.strip() == str(png)
    assert _png_size(png) == (1200, 360)  # figsize 12 x 3.6 in at 100 dpi
    image = pyplot.imread(png)
    assert image.shape[:2] == (360, 1200)
    assert np.unique(image.reshape(-1, image.shape[-1]), axis=0).shape[0] > 50  # drawn, not blank


def test_plot_without_metrics_says_what_to_do(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hpcgrad.plot", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no metrics.jsonl in" in done.stderr and "--checkpoint-dir" in done.stderr
