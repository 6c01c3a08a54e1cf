"""Run jobs/train_pipeline.py with one rank SIGKILLed at a phase of one multi-part save
(Note [Multi-part commit] in hpcgrad/training/checkpoint.py), through checkpoint._reached.

    mpiexec -n 2 python tests/scripts/ckpt26_kill.py PHASE RANK STEP [job arguments]

PHASE, for the save of step STEP, on rank RANK:
- ``before-parts``: before the rank writes its part;
- ``between-parts``: before the rank writes its part, once every other rank's part is on disk;
- ``after-parts``: (rank 0) every part durable, before the manifest is written;
- ``manifest-rename``: (rank 0) the manifest's temporary written and synced, before its rename;
- ``after-commit``: (rank 0) the manifest renamed, before old commits are pruned.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "jobs"))
import train_pipeline  # noqa: E402

from hpcgrad import checkpoint  # noqa: E402
from hpcgrad.comm.mpi import comm_world, exit_together  # noqa: E402

phase, victim, at_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, world = comm_world().Get_rank(), comm_world().Get_size()
current = {}


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def reached(where, **info):
    if "step" in info:
        current["step"] = info["step"]
    if rank != victim or current.get("step") != at_step:
        return
    if where == "part" and phase == "before-parts":
        die()
    if where == "part" and phase == "between-parts":
        others = [checkpoint.part_name(at_step, r, world) for r in range(world) if r != rank]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(info["directory"], name)) for name in others):
            assert time.monotonic() < deadline, "the other parts never appeared"
            time.sleep(0.01)
        die()
    if where == "parts-durable" and phase == "after-parts":
        die()
    if (where == "replace" and phase == "manifest-rename"
            and os.path.basename(info["path"]).startswith("commit-")):
        die()
    if where == "committed" and phase == "after-commit":
        die()


checkpoint._reached = reached
exit_together(train_pipeline.main(sys.argv[4:]))
