"""Fixture for tests/tools/test_coverage.py: every import form, names hpcgrad has and names it lacks."""
import argparse
import torch
import torch as th
import torch.nn as nn
import torch.nn.functional as F
from torch import optim, nn as tnn
from torch.nn import Linear
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef
import torch.fancy


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = Linear(4, 2)
        self.odd = tnn.Quux(3)

    def forward(self, x):
        return F.quux(F.relu(self.fc(x)))

    def custom_step(self):
        return self.fc.weight.frobnicate_()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    net = Net()
    opt = optim.SGD(net.parameters(), lr=args.lr)
    with th.no_grad():
        x = torch.ones(2, 4).wobble()
    y = net(x).sum()
    y.backward()
    opt.step()
    net.custom_step()
    dist.init_process_group()
    dist.all_reduce(y)
    rpc.Quux(RRef(y))
    th.fancy.thing()
    print(", ".join(["done"]), torch.nn.Quux)
