"""Fixture for tests/tools/test_coverage.py: the torch names a small MNIST training script uses, all in hpcgrad."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8 * 13 * 13, 10)

    def forward(self, images):
        hidden = F.max_pool2d(F.relu(self.conv(images)), 2)
        return F.log_softmax(self.head(torch.flatten(self.drop(hidden), 1)), dim=1)


def evaluate(model, batches):
    model.eval()
    right = 0
    with torch.no_grad():
        for images, labels in batches:
            guess = model(images).argmax(dim=1, keepdim=True)
            right += guess.eq(labels.view_as(guess)).sum().item()
    return right


def fit(batches, epochs=1):
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = StepLR(opt, step_size=1, gamma=0.7)
    for _ in range(epochs):
        model.train()
        for images, labels in batches:
            opt.zero_grad()
            F.nll_loss(model(images), labels).backward()
            opt.step()
        schedule.step()
    return evaluate(model, batches)
