"""SIGUSR2 writes this rank's flight record in a job without any process group, and the rank lives.

    HPCGRAD_FLIGHT_DIR=DIR python tests/scripts/diag_sigusr2.py alone
    HPCGRAD_FLIGHT_DIR=DIR mpiexec -n 2 python tests/scripts/diag_sigusr2.py rpc

``alone``: the program only imports hpcgrad and installs the handler (no init_process_group,
no RPC), then signals itself. ``rpc``: an RPC-only job (init_rpc, never init_process_group);
each rank installs the handler, signals itself, waits for its record, then makes an RPC to
its ring peer and shuts RPC down, so the rank is shown alive and serving after the dump.
Each rank prints "[rank R] dumped: True (reason ...)" and "[rank R] done"; exit status 0.
"""

import os
import signal
import sys
import time

import hpcgrad  # noqa: F401  (all a program without any group needs)
from hpcgrad.comm.flight_recorder import RECORDER, install_signal_handler

mode = sys.argv[1]
rank = RECORDER.rank
if mode == "rpc":
    import operator

    from hpcgrad.distributed import rpc
    rpc.init_rpc(f"worker{rank}")
    # Informative: whether init_rpc installed the handler itself (Note [Flight recorder]).
    print(f"[rank {rank}] handler installed by init_rpc: "
          f"{signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)}", flush=True)
print(f"[rank {rank}] handler installed: {install_signal_handler()}", flush=True)
path = os.path.join(RECORDER.directory, f"flight_rank{rank}.json")
os.kill(os.getpid(), signal.SIGUSR2)
deadline = time.monotonic() + 10
while not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.02)
with open(path) as f:
    reason = f.read().split('"reason": ')[1].split(",")[0]
print(f"[rank {rank}] dumped: {os.path.exists(path)} (reason {reason})", flush=True)
if mode == "rpc":
    peer = (rank + 1) % RECORDER.world_size
    print(f"[rank {rank}] rpc to worker{peer} gives "
          f"{rpc.rpc_sync(f'worker{peer}', operator.add, args=(rank, 40))}", flush=True)
    rpc.shutdown()
print(f"[rank {rank}] done", flush=True)
