"""static_graph=True, then a parameter the first iteration used goes unused: on every rank
(``all``) or on rank 1 only (``one``); or one rank 1 left out starts to be used (``late``). Every rank must raise PyTorch's static_graph error from
the backward that changed, before any optimizer step sees gradients that were not all-reduced.

    HPCGRAD_COMM_TIMEOUT=20 mpiexec -n 2 python tests/scripts/ddp26_static_unused.py all|one|late

Each rank prints ``step N done`` after each optimizer step, then, when backward raises, the
error, ``weights agree: True/False`` and ``gradients agree: ...`` (its parameters and their
.grad against every other rank's, gathered on the user's group), and exits 3. Finishing the loop without an error exits 0.
"""

import sys

import numpy as np

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.comm.mpi import exit_together
from hpcgrad.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)
        self.side = nn.Linear(3, 1)

    def forward(self, x, use_side):
        y = self.head(self.body(x).tanh())
        return y + self.side(x) if use_side else y


def side_used(step, rank, mode):
    """``all``, ``one``: every rank uses ``side`` in the first step; from the second on, nobody
    (``all``) or every rank but rank 1 (``one``). ``late``: rank 1 leaves ``side`` out of the
    first step only, so its hook fires in the second step where none was recorded."""
    if mode == "late":
        return rank != 1 or step > 0
    return step == 0 or (mode == "one" and rank != 1)


def main(mode):
    dist.init_process_group()
    rank = dist.get_rank()
    hg.manual_seed(rank)  # DDP starts every rank from rank 0's values
    model = Net().double()
    ddp = DistributedDataParallel(model, static_graph=True)
    rng = np.random.default_rng(rank)
    for step in range(4):
        x = hg.tensor(rng.standard_normal((4, 3)))
        try:
            ddp(x, side_used(step, rank, mode)).sum().backward()
        except RuntimeError as error:
            print(f"[rank {rank}] step {step} backward raised: {error}", flush=True)
            for what in ("weights", "gradients"):
                flat = np.concatenate([(p.array if what == "weights" else
                                        p.grad.array if p.grad is not None
                                        else np.full(p.shape, np.nan)).ravel()
                                       for p in model.parameters()])
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, flat)
                agree = all(np.array_equal(theirs, everyone[0]) for theirs in everyone)
                print(f"[rank {rank}] {what} agree: {agree}", flush=True)
            # Every rank raised here: exit 3 together, not through MPI_Abort, whose kill of the
            # job could drop these lines before the launcher forwarded them (seen in CI).
            exit_together(3)
        for p in model.parameters():  # SGD
            if p.grad is not None:
                p.array -= 0.1 * p.grad.array
                p.grad = None
        print(f"[rank {rank}] step {step} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
