"""Offline stand-in for torchvision's ``datasets.MNIST`` and the two ``transforms`` MNIST uses.

pytorch/examples download MNIST (60000 + 10000 images, 28x28); a machine without network cannot.
This module serves scikit-learn's handwritten digits instead (1797 images, 10 classes, shipped
inside scikit-learn, no download), drawn at MNIST's size: each 8x8 image (values 0..16) is scaled
to 0..255, every pixel repeated 3x3 (24x24) and padded by 2 on each side (28x28, a centred digit
as in MNIST). The split is the one of ``hpcgrad.data.load_digits``: a permutation from
``np.random.default_rng(0)``, 20% (359 images) in the test set, 1438 in the training set.
``OFFLINE_MNIST_SIZE=N`` in the environment keeps the first N images of each split (the tests'
tiny runs: the scripts have no option for fewer steps).

It is framework-free (numpy only), so the same port runs under hpcgrad and, with its imports
turned back, under PyTorch: items are ``(float32 array of shape (1, 28, 28), int label)``, which
both frameworks' default collate turn into tensors.
"""

import os
import types

import numpy as np

_TEST_FRACTION = 0.2


def _digits_28x28(train):
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("offline_mnist needs scikit-learn (its bundled digits stand in for "
                          "MNIST): pip install scikit-learn") from exc
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.kron(images, np.ones((1, 3, 3), dtype=np.uint8))
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = int(round(_TEST_FRACTION * len(labels)))
    rows = np.sort(order[n_test:] if train else order[:n_test])
    rows = rows[:int(os.environ.get("OFFLINE_MNIST_SIZE", len(rows)))]
    return images[rows], labels[rows]


class MNIST:
    """``torchvision.datasets.MNIST``'s signature; ``root`` and ``download`` are accepted and unused
    (nothing is read from or written to disk)."""

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        self.data, self.targets = _digits_28x28(train)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """uint8 (H, W) -> float32 (1, H, W) in [0, 1], as torchvision's ToTensor on a grey image."""

    def __call__(self, image):
        return (np.asarray(image, dtype=np.float32) / np.float32(255.0))[None]


class Normalize:
    """(image - mean) / std per channel."""

    def __init__(self, mean, std):
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]

    def __call__(self, image):
        return (image - self.mean) / self.std


# torchvision's names: ``from offline_mnist import datasets, transforms``
datasets = types.SimpleNamespace(MNIST=MNIST)
transforms = types.SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)
