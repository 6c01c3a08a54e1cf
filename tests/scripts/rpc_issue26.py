"""RPC shutdown and start-up as PyTorch's (Note [Quiet shutdown] in rpc/agent.py).

    mpiexec -n N python tests/scripts/rpc_issue26.py MODE

- ``cycles:C``: C rounds of init_rpc / work / shutdown. Each round every rank sends its ring
  peer a remote() (fetched, then dropped), an RRef of its own, an rpc_sync of 40 KB and five
  rpc_async of 24 KB it never waits for, then calls shutdown(); prints "cycle c ok".
- ``park``: every rank starts RPC with rpc_timeout=2 (the default RPC timeout); the workers
  call shutdown() at once while rank 0 "trains" for 5 s, calling each worker every 0.25 s.
- ``park_timeout``: as ``park``, but the workers call shutdown(timeout=1) and rank 0 trains
  for 4 s.
- ``allowed:DIR`` (2 ranks): rank 1 starts RPC with allowed=[identity, "numpy"]; rank 0
  (every rank trusted) asks it to run os.system("touch DIR/system"), and identity() of an
  object whose __reduce__ writes DIR/reduce when unpickled, then allowed calls; rank 1 sends
  rank 0 such an object too (DIR/trusted: rank 0 trusts, as PyTorch).
- ``signal``: RPC only (no process group); rank 1 gets SIGUSR2 (the flight recorder's dump
  signal) while rank 0 calls it, then both shut down.
"""

import os
import signal
import sys
import time

import numpy as np

import hpcgrad.distributed.rpc as rpc
from hpcgrad.comm.mpi import comm_world

mode = sys.argv[1]
rank, size = comm_world().Get_rank(), comm_world().Get_size()
peer = (rank + 1) % size


def served_by():
    return rank


def send_signal():
    os.kill(os.getpid(), signal.SIGUSR2)
    return "sent"


def identity(x):
    return x


def write_file(path):
    with open(path, "w") as f:
        f.write("written while unpickling\n")
    return path


class WritesWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (write_file, (self.path,))


if mode.startswith("allowed:"):
    where = mode.split(":", 1)[1]
    rpc.init_rpc(f"worker{rank}", allowed=[identity, "numpy"] if rank == 1 else None)
    if rank == 0:
        for what, call in [
                ("os.system", lambda: rpc.rpc_sync(1, os.system,
                                                   args=(f"touch {where}/system",))),
                ("__reduce__", lambda: rpc.rpc_sync(
                    1, identity, args=(WritesWhenUnpickled(f"{where}/reduce"),)))]:
            try:
                print(f"rank 0: {what} ran: {call()!r}", flush=True)
            except rpc.RpcError as exc:
                print(f"rank 0: {what} refused: {str(exc).splitlines()[0]}", flush=True)
        print(f"rank 0: allowed calls: {rpc.rpc_sync(1, identity, args=(np.float64(2.5),))!r} "
              f"{rpc.rpc_sync(1, np.add, args=(np.arange(3), 1)).tolist()}", flush=True)
    else:
        rpc.rpc_sync(0, identity, args=(WritesWhenUnpickled(f"{where}/trusted"),))
    rpc.shutdown()
    print(f"rank {rank} done", flush=True)
elif mode.startswith("cycles:"):
    for cycle in range(int(mode.split(":")[1])):
        rpc.init_rpc(f"worker{rank}")
        rref = rpc.remote(peer, np.add, args=(np.ones(3), cycle))
        fetched = rref.to_here()
        mine = rpc.RRef(np.ones(2000))
        total = rpc.rpc_sync(peer, np.sum, args=(np.full(5000, cycle, np.float64),))
        for _ in range(5):  # left unanswered when shutdown starts
            rpc.rpc_async(peer, np.add, args=(np.ones(3000), cycle))
        del rref, mine
        rpc.shutdown()
        ok = fetched.tolist() == [cycle + 1.0] * 3 and total == 5000.0 * cycle
        print(f"rank {rank}: cycle {cycle} {'ok' if ok else f'WRONG {fetched} {total}'}",
              flush=True)
    print(f"rank {rank} done", flush=True)
elif mode in ("park", "park_timeout"):
    rpc.init_rpc(f"worker{rank}",
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=2))
    if rank == 0:
        calls, deadline = 0, time.monotonic() + (5 if mode == "park" else 4)
        while time.monotonic() < deadline:  # "training", asking the parked workers
            for worker in range(1, size):
                assert rpc.rpc_sync(worker, served_by) == worker
            calls += 1
            time.sleep(0.25)
        print(f"rank 0: trained; {calls} calls served by each parked worker", flush=True)
        rpc.shutdown()
    elif mode == "park":
        rpc.shutdown()
    else:
        rpc.shutdown(timeout=1)
    print(f"rank {rank} done", flush=True)
elif mode == "signal":
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        print(f"rank 0: rank 1 {rpc.rpc_sync(1, send_signal)} SIGUSR2 to itself", flush=True)
        time.sleep(0.5)
        print(f"rank 0: rank 1 still serves: {rpc.rpc_sync(1, served_by) == 1}", flush=True)
    rpc.shutdown()
    print(f"rank {rank} done", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
