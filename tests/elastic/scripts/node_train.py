"""shrink_train.py whose ranks pause after each optimizer step once the world has shrunk.

    mpirun <ULFM line, over the cluster> -n 4 python node_train.py MODE VICTIMS STEP OUT [MIN]
Arguments and outputs: shrink_train.py's. With NODE_TRAIN_PAUSE=S in the environment (seconds,
default 0) each step on fewer ranks than at the start, but the first of them, ends with a sleep
of S (the first stays unslowed: tests time the kill -> first step on the shrunk world). A sleep
changes no number, so the parameters stay those of shrink_train.py; it keeps the survivors
training for a while after a node is lost, so that a runtime that ends the job then
(Note [A lost node under Open MPI 5.0.11] in tests/elastic/test_node_loss.py) does it while
they train, instead of racing their last few milliseconds of steps.
"""

import functools
import os
import runpy
import time
from pathlib import Path

import hpcgrad
import hpcgrad.distributed as dist

PAUSE = float(os.environ.get("NODE_TRAIN_PAUSE", "0"))
_step = hpcgrad.optim.SGD.step
_sizes = []  # the world's size at each step


@functools.wraps(_step)
def _step_then_pause(self, *args, **kwargs):
    result = _step(self, *args, **kwargs)
    _sizes.append(dist.get_world_size())
    if PAUSE and len(_sizes) > 1 and _sizes[-2] < _sizes[0]:  # not the shrunk world's first
        time.sleep(PAUSE)
    return result


hpcgrad.optim.SGD.step = _step_then_pause
runpy.run_path(str(Path(__file__).resolve().parent / "shrink_train.py"), run_name="__main__")
