"""A DDP training job that loses ranks (kill) or is told to drop them (plan), under elastic.run.

    mpirun <ULFM line> -n 4 python shrink_train.py MODE VICTIMS STEP OUT_DIR [MIN_SIZE]
MODE: kill (each victim does os._exit(9) at the top of its step), kill9 (it sends itself
SIGKILL, as `kill -9` would), hang (it sleeps for an hour instead), plan (every rank calls
state.leave(victims) at the top of their step), none. VICTIMS: world ranks, each RANK or
RANK@STEP (default STEP): "2,3" (a simulated node), "1@5,3@9" (two failures in turn).
Commits every COMMIT steps. Each survivor writes OUT_DIR/rank<R>.json (its changes, timings)
and rank<R>.npy (final parameters); below MIN_SIZE ranks (default 2) each survivor writes
OUT_DIR/too_small<R>.json and ends.
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

MODE, STEP, OUT = sys.argv[1], int(sys.argv[3]), sys.argv[4]
SCHEDULE = {}  # step -> the world ranks that go at its top
for item in sys.argv[2].split(","):
    rank, _, at = item.partition("@")
    SCHEDULE.setdefault(int(at) if at else STEP, []).append(int(rank))
VICTIMS = sorted(r for ranks in SCHEDULE.values() for r in ranks)
MIN_SIZE = int(sys.argv[5]) if len(sys.argv) > 5 else 2
COMMIT, BATCH, EPOCHS, N = 2, 4, 2, 96

dist.init_process_group()
world_rank = dist.get_rank()
rng = np.random.default_rng(0)
X = rng.standard_normal((N, 8)).astype(np.float32)
Y = rng.standard_normal((N, 2)).astype(np.float32)

hpcgrad.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
optimizer = hpcgrad.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = elastic.ElasticSampler(X, dist.get_world_size(), dist.get_rank(), seed=1)
state = elastic.State(model, optimizer, sampler=sampler)
changes, first_step_after = [], []


def on_change(change):
    changes.append({"old": change.old_size, "new": change.new_size, "lost": list(change.lost),
                    "rank": change.rank, "restored_step": change.restored_step,
                    "seconds": change.seconds, "planned": change.planned})
    first_step_after.append(None)
    print(f"[world rank {world_rank}] {change}", flush=True)


@elastic.run(min_size=MIN_SIZE, on_change=on_change)
def train(state):
    while state.epoch < EPOCHS:
        state.sampler.set_epoch(state.epoch)
        order = list(state.sampler)
        for start in range(0, len(order) - BATCH + 1, BATCH):
            going = SCHEDULE.get(state.step, [])
            if MODE in ("kill", "kill9") and world_rank in going:
                with open(os.path.join(OUT, f"killed{world_rank}.json"), "w") as f:
                    json.dump({"time": time.time(), "step": state.step}, f)
                if MODE == "kill9":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(9)
            if MODE == "hang" and world_rank in going:
                with open(os.path.join(OUT, f"hung{world_rank}.json"), "w") as f:
                    json.dump({"time": time.time(), "step": state.step}, f)
                time.sleep(3600)
            if MODE == "plan" and going and len(changes) == sorted(SCHEDULE).index(state.step):
                state.leave(going)
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


try:
    steps = train(state)
except elastic.WorldTooSmallError as error:  # the place to save a checkpoint for requeue
    with open(os.path.join(OUT, f"too_small{world_rank}.json"), "w") as f:
        json.dump({"message": str(error), "step": state.step, "new": error.change.new_size}, f)
    sys.exit(0)
if steps is not None:
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    np.save(os.path.join(OUT, f"rank{world_rank}.npy"), params)
    with open(os.path.join(OUT, f"rank{world_rank}.json"), "w") as f:
        json.dump({"steps": steps, "size": dist.get_world_size(), "changes": changes,
                   "first_step_after": first_step_after}, f)
    print(f"[world rank {world_rank}] done: {steps} steps on {dist.get_world_size()} ranks",
          flush=True)
