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
        return float((model(images).array.argmax(1) == labels.array).mean())


# Thresholds with a margin measured over seeds. A seeded run is reproducible on one machine
# only: another BLAS kernel rounds a product differently and, after a few hundred SGD steps,
# the run ends elsewhere (seed 0's CNN: >= 0.93 where this test was written, 0.908 in issue 25's
# run and in the measurement below), so a
# threshold must hold for the spread over seeds, not for one seed's figure. Test accuracy after
# 6 epochs, seeds 0-19 (manual_seed(s) and the loader's default_rng(s), the code below; numpy's
# OpenBLAS 0.3.31; one test sample = 0.0028):
#   mlp  min 0.933  mean 0.960  std 0.012  (threshold 0.90: mean - 5 std)
#   cnn  min 0.905  mean 0.942  std 0.021  (threshold 0.85: mean - 4.4 std)
#   cnn per seed: .908 .930 .925 .969 .939 .964 .950 .933 .905 .939
#                 .969 .972 .969 .936 .908 .919 .947 .950 .953 .947
# An untrained model scores ~0.1 (0.05-0.16 over those seeds), so either threshold still
# catches a model that does not learn.
SEED = 0


@pytest.mark.parametrize("kind,epochs,expected", [("mlp", 6, 0.90), ("cnn", 6, 0.85)])
def test_model_learns_digits(kind, epochs, expected):
    hg.manual_seed(SEED)
    model = MODELS[kind]()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = load_digits("train")
    loader = DataLoader(train, batch_size=32, shuffle=True,
                        generator=np.random.default_rng(SEED))
    before = accuracy(model, load_digits("test"))
    for _ in range(epochs):
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = accuracy(model, load_digits("test"))
    assert before < 0.3 and after >= expected, (before, after)
