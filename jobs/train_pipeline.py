"""Pipeline-parallel training of an MLP on scikit-learn's digits: one stage per rank, distributed autograd.

    mpiexec -n 3 python jobs/train_pipeline.py                 # 2 to 4 ranks; a few seconds
    mpiexec -n 2 python jobs/train_pipeline.py --epochs 3

The MLP 64-128-128-64-10 (ReLU between layers) is cut into one contiguous stage per rank; each
rank owns its stage's parameters. Per batch, inside one distributed-autograd context per rank:
rank 0 feeds the images to its stage and ``dist_autograd.send``s the activations to rank 1,
which ``recv``s them, applies its stage and sends on; the last rank computes the cross-entropy
loss and runs ``dist_autograd.backward``, which carries the gradients back rank by rank; the
other ranks ``wait_for_backward``. Every rank then steps its own parameters with a local SGD
from ``get_gradients(ctx)`` (``.grad`` is never written by distributed autograd). One batch is
in flight at a time (no micro-batch overlap). All ranks shuffle with the same seed, so the last
rank's labels line up with rank 0's images. After each epoch the test set goes through the
pipeline without a context, and the last rank sends the epoch's figures to rank 0, which prints.
"""

import argparse
import sys
import time

import numpy as np
from job_args import integer, real

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad import optim
from hpcgrad.comm.mpi import comm_world
from hpcgrad.data import load_digits

WIDTHS = (64, 128, 128, 64, 10)  # 4 Linear layers: one stage each on 4 ranks


def stage_layers(rank, world):
    """The Linear layers (indices) of ``rank``'s stage: contiguous, as even as possible."""
    layers = len(WIDTHS) - 1
    bounds = np.linspace(0, layers, world + 1).round().astype(int)
    return range(bounds[rank], bounds[rank + 1])


def build_stage(rank, world, seed):
    """``rank``'s part of the MLP, initialised from a seed of its own."""
    hg.manual_seed(seed * 1000 + rank)
    modules = []
    for i in stage_layers(rank, world):
        modules.append(nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i + 1 < len(WIDTHS) - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=integer(1, "epochs to train", 5), default=5)
    p.add_argument("--batch-size", type=integer(1, "samples per step", 32), default=32)
    p.add_argument("--lr", type=real("the learning rate", 0.1), default=0.1)
    p.add_argument("--momentum", type=real("SGD momentum", 0.9), default=0.9)
    p.add_argument("--seed", type=integer(0, "the random seed", 0), default=0)
    p.add_argument("--timeout", type=real("seconds any rank waits for another", 60,
                                          positive=True),
                   default=60, help="seconds any rank waits for another")
    return p.parse_args(argv)


def train_step(stage, optimizer, images, labels, rank, last, timeout):
    """One batch through the pipeline and back; returns (loss, correct) on the last rank."""
    with dist_autograd.context() as ctx:
        h = images if rank == 0 else dist_autograd.recv(rank - 1, timeout=timeout)
        out = stage(h)
        result = None
        if rank < last:
            dist_autograd.send(out, rank + 1)
            dist_autograd.wait_for_backward(ctx, timeout=timeout)
        else:
            loss = F.cross_entropy(out, labels)
            dist_autograd.backward(ctx, [loss], timeout=timeout)
            result = (loss.item(), int((out.data.argmax(1) == labels.data).sum()))
        grads = dist_autograd.get_gradients(ctx)
    for p in stage.parameters():
        p.grad = grads.get(p)
    optimizer.step()
    for p in stage.parameters():
        p.grad = None
    return result


def evaluate(stage, images, labels, rank, last, timeout):
    """Test accuracy through the pipeline, no context (nothing to differentiate): last rank."""
    with hg.no_grad():
        h = images if rank == 0 else dist_autograd.recv(rank - 1, timeout=timeout)
        out = stage(h)
    if rank < last:
        dist_autograd.send(out, rank + 1)
        return None
    return float((out.data.argmax(1) == labels.data).mean())


def main(argv=None):
    args = parse_args(argv)
    rank, world = comm_world().Get_rank(), comm_world().Get_size()
    if not 2 <= world <= len(WIDTHS) - 1:
        if rank == 0:
            print(f"train_pipeline: run with 2 to {len(WIDTHS) - 1} ranks (one stage each), "
                  f"e.g. mpiexec -n 3 python jobs/train_pipeline.py; got {world}",
                  file=sys.stderr)
        return 2
    last = world - 1
    rpc.init_rpc(f"stage{rank}")
    stage = build_stage(rank, world, args.seed)
    optimizer = optim.SGD(stage.parameters(), lr=args.lr, momentum=args.momentum)
    train, test = load_digits("train", flatten=True), load_digits("test", flatten=True)
    train_x, train_y = (t.data for t in train.tensors)
    test_x, test_y = (t.data for t in test.tensors)
    if rank == 0:
        layers = [list(stage_layers(r, world)) for r in range(world)]
        print(f"pipeline of {world} stages (Linear layers per rank: {layers}), "
              f"{len(train_y)} training images, batch {args.batch_size}", flush=True)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng(args.seed + epoch).permutation(len(train_y))
        loss_sum = correct = 0.0
        for start in range(0, len(order), args.batch_size):
            rows = order[start:start + args.batch_size]
            x = hg.tensor(train_x[rows]) if rank == 0 else None
            y = hg.tensor(train_y[rows]) if rank == last else None
            result = train_step(stage, optimizer, x, y, rank, last, args.timeout)
            if result is not None:
                loss_sum += result[0] * len(rows)
                correct += result[1]
        accuracy = evaluate(stage, hg.tensor(test_x) if rank == 0 else None,
                            hg.tensor(test_y) if rank == last else None, rank, last, args.timeout)
        if rank == last:  # the figures travel to rank 0, which reports
            dist_autograd.send(hg.tensor([loss_sum / len(order), correct / len(order),
                                          accuracy]), 0)
        if rank == 0:
            loss, train_acc, test_acc = dist_autograd.recv(last, timeout=args.timeout).data
            print(f"epoch {epoch + 1}/{args.epochs}  loss {loss:.4f}  train accuracy "
                  f"{train_acc:.4f}  test accuracy {test_acc:.4f}  "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
