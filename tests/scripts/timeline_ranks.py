"""Each rank records a forward and a backward span with HPCGRAD_TIMELINE set (saved at exit).

    HPCGRAD_TIMELINE=/tmp/t.json mpiexec -n 2 python tests/scripts/timeline_ranks.py
"""

import time

from hpcgrad.base.timeline import TIMELINE

with TIMELINE.span("forward", "step", step=1):
    time.sleep(0.01)
with TIMELINE.span("backward", "step", step=1):
    TIMELINE.instant("bucket 0 ready", "ddp")
    time.sleep(0.01)
