"""A DDP job with SyncBatchNorm and ZeroRedundancyOptimizer (Adam) that loses a rank (kill9) or
is told to drop it (plan), under elastic.run (Note [ZeRO under elastic.run]).

    mpirun <ULFM line> -n 4 python zero_train.py MODE VICTIMS STEP OUT_DIR
MODE: kill9 (each victim sends itself SIGKILL at the top of step STEP), plan (every rank calls
state.leave(victims) at the top of step STEP), none. VICTIMS: world ranks, "1" or "2,3".
Commits every COMMIT steps. Each survivor writes OUT_DIR/rank<R>.json (its changes, its
optimizer's world and shard) and rank<R>.npz (the model's state_dict: parameters and
SyncBatchNorm's running statistics); the last world's rank 0 writes OUT_DIR/optimizer.npz,
the consolidated optimizer state (``consolidate_state_dict``, ``state_dict``).
"""

import json
import os
import signal
import sys
import time

import numpy as np

import hpcgrad
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.distributed import elastic
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer

MODE, VICTIMS, STEP, OUT = (sys.argv[1], [int(r) for r in sys.argv[2].split(",")],
                            int(sys.argv[3]), sys.argv[4])
COMMIT, BATCH, EPOCHS, N = 2, 4, 2, 96

dist.init_process_group()
world_rank = dist.get_rank()
rng = np.random.default_rng(0)
X = (3 * rng.standard_normal((N, 8)) + 1).astype(np.float32)
Y = rng.standard_normal((N, 2)).astype(np.float32)

hpcgrad.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.SyncBatchNorm(16), nn.Tanh(), nn.Linear(16, 8),
                      nn.SyncBatchNorm(8), nn.Tanh(), nn.Linear(8, 2))
optimizer = ZeroRedundancyOptimizer(model.parameters(), hpcgrad.optim.Adam, lr=0.01)
sampler = elastic.ElasticSampler(X, dist.get_world_size(), dist.get_rank(), seed=1)
state = elastic.State(model, optimizer, sampler=sampler)
changes, first_step_after = [], []


def on_change(change):
    changes.append({"old": change.old_size, "new": change.new_size, "lost": list(change.lost),
                    "rank": change.rank, "restored_step": change.restored_step,
                    "seconds": change.seconds, "planned": change.planned})
    first_step_after.append(None)
    print(f"[world rank {world_rank}] {change}", flush=True)


@elastic.run(min_size=2, on_change=on_change)
def train(state):
    while state.epoch < EPOCHS:
        state.sampler.set_epoch(state.epoch)
        order = list(state.sampler)
        for start in range(0, len(order) - BATCH + 1, BATCH):
            if state.step == STEP and not changes:
                if MODE == "kill9" and world_rank in VICTIMS:
                    with open(os.path.join(OUT, f"killed{world_rank}.json"), "w") as f:
                        json.dump({"time": time.time(), "step": state.step}, f)
                    os.kill(os.getpid(), signal.SIGKILL)
                if MODE == "plan":
                    state.leave(VICTIMS)
            batch = order[start:start + BATCH]
            x, y = hpcgrad.tensor(X[batch]), hpcgrad.tensor(Y[batch])
            loss = ((state.ddp(x) - y) ** 2).mean()
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.sampler.record_batch(len(batch))
            state.step += 1
            if first_step_after and first_step_after[-1] is None:
                first_step_after[-1] = time.time()
            if state.step % COMMIT == 0:
                state.commit()
        state.epoch += 1
        state.commit()
    return state.step


steps = train(state)
if steps is not None:
    zero = state.optimizer
    zero.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        whole = zero.state_dict()
        np.savez(os.path.join(OUT, "optimizer.npz"), **{
            f"{index}.{name}": np.asarray(value) for index, entry in whole["state"].items()
            for name, value in entry.items()})
    np.savez(os.path.join(OUT, f"rank{world_rank}.npz"),
             **{name: t.numpy() for name, t in model.state_dict().items()})
    shard = [p for g in zero.optim.param_groups for p in g["params"]]
    with open(os.path.join(OUT, f"rank{world_rank}.json"), "w") as f:
        json.dump({"steps": steps, "size": dist.get_world_size(), "changes": changes,
                   "first_step_after": first_step_after, "same_optimizer": zero is optimizer,
                   "zero_world": zero.world_size, "zero_rank": zero.rank,
                   "shard_params": len(shard), "state_params": len(zero.optim.state)}, f)
    print(f"[world rank {world_rank}] done: {steps} steps on {dist.get_world_size()} ranks",
          flush=True)
