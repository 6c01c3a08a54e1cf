"""RRef proxies under init_rpc(allowed=...) (2 ranks), for tests/rpc/test_rpc_issue27.py.

Rank 1 allows the class Box only. Rank 0 calls Box's public method through each proxy (allowed),
a private one (refused), and a public method of Other, a class Box made on rank 1 and that
rank 1 does not allow (refused). Prints what each call gave.
"""

import hpcgrad.distributed.rpc as rpc
from hpcgrad.comm.mpi import comm_world


class Other:
    def get(self):
        return "other"


class Box:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value

    def _secret(self):
        return "secret"

    def other(self):
        return Other()


rank = comm_world().Get_rank()
rpc.init_rpc(f"worker{rank}", allowed=[Box] if rank == 1 else None)
if rank == 0:
    box = rpc.remote(1, Box, args=(2,))
    print(f"rank 0: allowed: {box.rpc_sync().get()} {box.rpc_async().get().wait()} "
          f"{box.remote().get().to_here()}", flush=True)
    for what, call in [("_secret", lambda: box.rpc_sync()._secret()),
                       ("Other.get", lambda: box.remote().other().rpc_sync().get())]:
        try:
            print(f"rank 0: {what} ran: {call()!r}", flush=True)
        except rpc.RpcError as exc:
            print(f"rank 0: {what} refused: {str(exc).splitlines()[0]}", flush=True)
rpc.shutdown()
print(f"rank {rank} done", flush=True)
