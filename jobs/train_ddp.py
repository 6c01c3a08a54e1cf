"""Data-parallel training of a small CNN or MLP on scikit-learn's digits, with resumable checkpoints.

    mpiexec -n 2 python jobs/train_ddp.py                  # train (a few seconds)
    mpiexec -n 2 python jobs/train_ddp.py --resume         # continue from checkpoints/last.npz
    sbatch slurm/train_ddp.sbatch                          # on a cluster

Each rank trains on its DistributedSampler shard; DistributedDataParallel averages gradients.
Rank 0 shows progress, saves checkpoints atomically every --checkpoint-every steps and at the
end of each epoch, and on SIGTERM/SIGUSR1 (preemption) all ranks stop at the next step after a
final checkpoint, so --resume continues exactly where the job stopped.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
from job_args import directory, integer, real

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad import checkpoint, optim
from hpcgrad.data import DataLoader, DistributedSampler, load_digits
from hpcgrad.nn.parallel import DistributedDataParallel


def build_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--epochs", type=integer(1, "epochs to train", 8), default=8)
    p.add_argument("--batch-size", type=integer(1, "samples per rank and step", 32), default=32,
                   help="per rank")
    p.add_argument("--lr", type=real("the learning rate", 0.05), default=0.05)
    p.add_argument("--momentum", type=real("SGD momentum", 0.9), default=0.9)
    p.add_argument("--seed", type=integer(0, "the random seed", 0), default=0)
    p.add_argument("--bucket-cap-mb", type=real("DDP's bucket size in MB", 25, positive=True),
                   default=25)
    p.add_argument("--checkpoint-dir", type=directory, default="checkpoints")
    p.add_argument("--checkpoint-every", type=integer(0, "steps between checkpoints", 50),
                   default=50, help="steps (0: epoch ends only)")
    p.add_argument("--resume", action="store_true", help="continue from <checkpoint-dir>/last.npz")
    p.add_argument("--max-steps", type=integer(0, "steps before stopping, 0: no limit", 30),
                   default=0, help="stop after this many steps (tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    return p.parse_args(argv)


class Preemption:
    """SIGTERM/SIGUSR1 set a flag; ranks agree on it at step boundaries (one tiny all-reduce)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self):
        flag = np.array([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0])


def evaluate(model, loader):
    """Accuracy over every rank's shard of ``loader`` (summed across ranks)."""
    model.eval()
    counts = np.zeros(2)
    with hg.no_grad():
        for images, labels in loader:
            predicted = model(images).data.argmax(1)
            counts += [(predicted == labels.data).sum(), len(labels.data)]
    model.train()
    dist.all_reduce(counts)
    return counts[0] / counts[1]


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    hg.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    train, test = load_digits("train"), load_digits("test")
    sampler = DistributedSampler(train, seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test, batch_size=256, sampler=DistributedSampler(test, shuffle=False))
    path = os.path.join(args.checkpoint_dir, "last.npz")
    step, start_epoch, skip = 0, 0, 0
    if args.resume:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--resume: no checkpoint at {path}; run without --resume "
                                    "first, or point --checkpoint-dir at it")
        meta = checkpoint.load(path, model, optimizer)
        step, start_epoch, skip = meta["step"], meta["epoch"], meta["batches_done"]
        if rank == 0:
            print(f"resumed from {path}: epoch {start_epoch}, step {step}", flush=True)
    preemption = Preemption()

    def save(epoch, batches_done):
        if rank == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            checkpoint.save(path, model, optimizer, step=step, epoch=epoch,
                            batches_done=batches_done, world_size=world, args=vars(args))
        dist.barrier()  # nobody reads or overwrites it before it is complete

    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        progress = tqdm(total=args.epochs * len(train_loader), initial=step, unit="step",
                        dynamic_ncols=True, file=sys.stdout)
    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for batch, (images, labels) in enumerate(train_loader):
            if batch < skip:
                continue  # already trained before the checkpoint we resumed from
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(loss.item())
            if progress is not None:
                progress.update(1)
                progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
            stop = preemption.agreed() or (args.max_steps and step >= args.max_steps)
            if stop or (args.checkpoint_every and step % args.checkpoint_every == 0):
                save(epoch, batch + 1)
            if stop:
                if rank == 0:
                    print(f"\nstopped at step {step}; checkpoint {path}; continue with --resume",
                          flush=True)
                return 0
        skip = 0
        mean_loss = np.array([np.mean(losses) if losses else 0.0, 1.0 if losses else 0.0])
        dist.all_reduce(mean_loss)
        accuracy = evaluate(model, test_loader)
        save(epoch + 1, 0)
        if rank == 0:
            message = (f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss[0] / max(mean_loss[1], 1):.4f}"
                       f"  test accuracy {accuracy:.4f}  ({time.perf_counter() - started:.1f} s)")
            (progress.write if progress is not None else print)(message)
    if progress is not None:
        progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
