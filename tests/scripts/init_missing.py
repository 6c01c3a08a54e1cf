"""One rank never joins start-up: the others must not wait forever (Note [Bounded start-up]).

    mpiexec -n 3 python tests/scripts/init_missing.py MODE MISSING

Rank MISSING sleeps (far longer than any bound) instead of calling the start-up of MODE;
the others call it with a 2 s bound:
- ``init_process_group``: init_process_group(timeout=2)
- ``env``: init_process_group() with HPCGRAD_COMM_TIMEOUT=2 set by the caller
- ``init_rpc``: rpc.init_rpc(name, rpc_backend_options=TensorPipeRpcBackendOptions(rpc_timeout=2))
- ``new_group``: every rank starts the default group (timeout 2); rank MISSING then skips
  new_group([0, 1])
"""

import sys
import time

import hpcgrad.distributed as dist
from hpcgrad.comm.mpi import comm_world
from hpcgrad.distributed import rpc

mode, missing = sys.argv[1], int(sys.argv[2])
rank = comm_world().Get_rank()
if mode == "new_group":
    dist.init_process_group(timeout=2)
if rank == missing:
    time.sleep(300)
    sys.exit(0)
if mode == "init_process_group":
    dist.init_process_group(timeout=2)
elif mode == "env":
    dist.init_process_group()
elif mode == "init_rpc":
    rpc.init_rpc(f"worker{rank}",
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=2))
elif mode == "new_group":
    dist.new_group([0, 1])
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {rank}: {mode} returned although rank {missing} never called it", flush=True)
