"""Real training, single process: an MLP and a small CNN learn scikit-learn's digits (seeded)."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad import optim
from hpcgrad.data import DataLoader, load_digits

pytest.importorskip("sklearn")

MODELS = {
    "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
    "cnn": lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Flatten(), nn.Linear(64, 10)),
}


def accuracy(model, dataset):
    images, labels = dataset.tensors
    with hg.no_grad():
        return float((model(images).data.argmax(1) == labels.data).mean())


@pytest.mark.parametrize("kind,epochs,expected", [("mlp", 6, 0.93), ("cnn", 6, 0.93)])
def test_model_learns_digits(kind, epochs, expected):
    hg.manual_seed(0)
    model = MODELS[kind]()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = load_digits("train")
    loader = DataLoader(train, batch_size=32, shuffle=True,
                        generator=np.random.default_rng(0))
    before = accuracy(model, load_digits("test"))
    for _ in range(epochs):
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = accuracy(model, load_digits("test"))
    assert before < 0.3 and after >= expected, (before, after)
