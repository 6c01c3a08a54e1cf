"""SIGUSR2 writes the flight record while the main thread is blocked inside MPI.

    HPCGRAD_FLIGHT_DIR=DIR python tests/scripts/flight_signal.py

One process: the main thread records a receive and blocks in MPI_Recv; a helper thread sends
the process SIGUSR2, waits (bounded) for the record to appear, then sends the awaited message so
the main thread returns. A Python-level handler alone could not dump here: it runs only once the
main thread is back in the interpreter. Prints what the record says.
"""

import json
import os
import signal
import threading
import time

import numpy as np

from hpcgrad.comm.flight_recorder import RECORDER, install_signal_handler
from hpcgrad.comm.mpi import MPI

comm = MPI.COMM_WORLD
path = os.path.join(RECORDER.directory, "flight_rank0.json")
group = RECORDER.register_group([0], "default")
print(f"installed: {install_signal_handler()}", flush=True)


def poke():
    time.sleep(0.5)  # the main thread is in MPI_Recv by now
    os.kill(os.getpid(), signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"dumped while blocked: {os.path.exists(path)}", flush=True)
    comm.Send(np.ones(3), dest=0, tag=5)


helper = threading.Thread(target=poke)
helper.start()
buf = np.zeros(3)
slot = RECORDER.begin(group, 1, "recv", 0, buf)
comm.Recv(buf, source=0, tag=5)
RECORDER.end(slot)
helper.join(15)
with open(path) as f:
    record = json.load(f)
last = record["entries"][-1]
print(f"reason: {record['reason']}; last call: {last['op']} from {last['peer']}, {last['state']}",
      flush=True)
