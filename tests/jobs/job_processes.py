"""Find a launched job's rank processes (to signal one rank of a running job in a test)."""

import os
import time
from pathlib import Path


def rank_pid(script, checkpoint_dir, rank, deadline):
    """The pid of rank ``rank`` of ``script`` whose command line names ``checkpoint_dir``."""
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(script).encode() in cmdline and str(checkpoint_dir).encode() in cmdline and any(
                    v in environ for v in (b"PMI_RANK=%d" % rank,
                                           b"OMPI_COMM_WORLD_RANK=%d" % rank)):
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} of {script} for {checkpoint_dir} found")
