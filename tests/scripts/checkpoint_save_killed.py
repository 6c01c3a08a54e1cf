"""Start a checkpoint save that stops mid-way (STAGE) and waits to be SIGKILLed by the test.

    python checkpoint_save_killed.py STAGE PATH READY
STAGE: "mid_write" stops after the first array of the temporary file is written;
       "before_replace" stops after the temporary file is complete and synced, before the rename.
The script creates the file READY (holding the temporary file's path) when it has stopped.
"""

import os
import sys
import time
import numpy as np

from hpcgrad import checkpoint, nn

stage, path, ready = sys.argv[1:4]
real_replace = os.replace  # the before_replace stage patches os.replace


def stop_here(tmp_path):
    with open(ready + ".part", "w") as f:
        f.write(tmp_path)
    real_replace(ready + ".part", ready)
    time.sleep(120)  # the test kills us long before this ends
    sys.exit("not killed")


def temporary_files():
    """The temporary checkpoint being written (save chooses its name)."""
    directory = os.path.dirname(os.path.abspath(path))
    return [os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".tmp")]


if stage == "mid_write":
    real_write_array = np.lib.format.write_array
    calls = []

    def write_array(fp, array, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stop_here(temporary_files()[0])
        return real_write_array(fp, array, *args, **kwargs)

    np.lib.format.write_array = write_array
elif stage == "before_replace":
    checkpoint.os.replace = lambda src, dst: stop_here(src)
else:
    sys.exit(f"unknown stage {stage!r}")


checkpoint.save(path, nn.Linear(256, 256), step=999)
