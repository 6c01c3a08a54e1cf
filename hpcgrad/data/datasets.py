"""Ready-made datasets: scikit-learn's handwritten digits (an optional extra) and a synthetic set."""

import importlib.util
import os

import numpy as np

from hpcgrad.data.dataset import TensorDataset

_DIGITS_EXTRA = "pip install 'hpcgrad[datasets]'"


def load_digits(split="train", flatten=False, test_fraction=0.2, seed=0):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes) as a TensorDataset.

    Images are float32 in [0, 1] (the 0..16 pixel values / 16), shape (N, 1, 8, 8), or (N, 64)
    with ``flatten=True``; labels are int64. The split is deterministic: a permutation drawn from
    ``np.random.default_rng(seed)`` puts ``round(test_fraction * 1797)`` images in "test" and the
    rest in "train", so the two never overlap. The data ship inside scikit-learn (no download).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    pixels, target = _digits_table()
    images = (pixels.reshape(-1, 8, 8).astype(np.float32) / np.float32(16.0))
    labels = target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(test_fraction * len(labels)))
    rows = np.sort(order[:n_test] if split == "test" else order[n_test:])
    images = images[rows]
    images = images.reshape(len(rows), -1) if flatten else images[:, None, :, :]
    return TensorDataset(np.ascontiguousarray(images), labels[rows])


def _digits_table():
    """(pixels (1797, 64), labels) from the file scikit-learn ships, as its load_digits reads it.

    Importing scikit-learn (scipy's docstring parsing above all) took 3-4 s per process, most of
    a launched job's start-up; its data file is read directly instead (the same values, checked
    against sklearn.datasets.load_digits in tests/data/test_dataloader.py).
    """
    spec = importlib.util.find_spec("sklearn")
    path = None if spec is None or spec.origin is None else os.path.join(
        os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if path is None or not os.path.exists(path):
        raise ImportError(f"hpcgrad.data.load_digits needs scikit-learn's digits, which are not "
                          f"installed; install the optional extra: {_DIGITS_EXTRA}")
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1]


def synthetic_classification(n, features, classes, seed=0, noise=0.5):
    """``n`` samples of ``classes`` Gaussian blobs in ``features`` dimensions: a set a small model
    learns quickly. Centres are drawn at distance ~3 apart, each sample is its centre plus
    ``noise`` * standard normal. Returns a TensorDataset (float32 features, int64 labels)."""
    if n < 1 or features < 1 or classes < 2:
        raise ValueError(f"need n >= 1, features >= 1, classes >= 2; got n={n}, "
                         f"features={features}, classes={classes}")
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, features)) * (3.0 / np.sqrt(2.0))
    labels = rng.integers(0, classes, size=n)
    x = centres[labels] + noise * rng.standard_normal((n, features))
    return TensorDataset(x.astype(np.float32), labels.astype(np.int64))
