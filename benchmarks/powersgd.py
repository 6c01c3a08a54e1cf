"""PowerSGD on the digits CNN of jobs/train_ddp.py: bytes sent per step and final test accuracy.

    mpiexec -n 2 python benchmarks/powersgd.py                    # ranks 1, 2, 4 vs uncompressed
    mpiexec -n 2 python benchmarks/powersgd.py --seeds 0 1 2 --epochs 8

Each run trains build_model("cnn") from jobs/train_ddp.py with DDP and SGD(momentum) on
DistributedSampler shards, the same seed, data order and steps for every row; only the comm hook
differs: none (plain all-reduce) or powerSGD_hook at matrix_approximation_rank r, vanilla
all-reduce for the first --start-iter steps. Bytes per step: what one rank hands to its
all-reduces in a compressed step (PowerSGDState.bytes_per_step: P, Q and the uncompressed
tensors) beside the whole gradient (what plain DDP all-reduces). Accuracy: over the 359 test
samples, each counted once, after the last epoch.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs"))

from train_ddp import EvaluationShard, build_model, evaluate

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn.functional as F
from hpcgrad import optim
from hpcgrad.data import DataLoader, DistributedSampler, load_digits
from hpcgrad.ddp.comm_hooks import PowerSGDState, powerSGD_hook
from hpcgrad.nn.parallel import DistributedDataParallel


def train(rank_r, seed, args):
    """(test accuracy, bytes sent per step, bytes uncompressed) of one run; rank_r None: no hook."""
    hg.manual_seed(seed)
    model = DistributedDataParallel(build_model("cnn"))
    state = None
    if rank_r is not None:
        state = PowerSGDState(None, matrix_approximation_rank=rank_r,
                              start_powerSGD_iter=args.start_iter, random_seed=seed)
        model.register_comm_hook(state, powerSGD_hook)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_set, test_set = load_digits("train"), load_digits("test")
    sampler = DistributedSampler(train_set, seed=seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=EvaluationShard(
        len(test_set), dist.get_rank(), dist.get_world_size()))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    _, accuracy = evaluate(model, test_loader)
    total = sum(p.array.nbytes for p in model.parameters())
    sent = state.bytes_per_step if state is not None else total
    return accuracy, sent, total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                   help="PowerSGD matrix_approximation_rank values")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--start-iter", type=int, default=20,
                   help="start_powerSGD_iter: plain all-reduce steps first")
    args = p.parse_args()
    dist.init_process_group()
    me, world = dist.get_rank(), dist.get_world_size()
    rows = [("uncompressed", None)] + [(f"PowerSGD rank {r}", r) for r in args.ranks]
    results = {name: [train(r, seed, args) for seed in args.seeds] for name, r in rows}
    if me != 0:
        return
    print(f"digits CNN, {world} ranks, batch {args.batch_size} per rank, {args.epochs} epochs, "
          f"lr {args.lr}, start_powerSGD_iter {args.start_iter}, seeds {args.seeds}")
    print(f"{'':18s} {'bytes/step':>11s} {'vs full':>8s} {'accuracy (per seed)':>28s} "
          f"{'mean':>7s} {'diff':>7s}")
    base = statistics.mean(a for a, _, _ in results["uncompressed"])
    for name, _ in rows:
        accs = [a for a, _, _ in results[name]]
        _, sent, total = results[name][0]
        mean = statistics.mean(accs)
        print(f"{name:18s} {sent:11,d} {sent / total:8.3f} "
              f"{' '.join(f'{a:.4f}' for a in accs):>28s} {mean:7.4f} {mean - base:+7.4f}")


if __name__ == "__main__":
    main()
