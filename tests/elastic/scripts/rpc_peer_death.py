"""An RPC job under ULFM loses a worker while an RPC to it is pending (test_rpc_failure.py).

    mpirun <ULFM line> -n 3 python rpc_peer_death.py MODE OUT_DIR
MODE: exit (rank 2 calls os._exit(9)) or kill9 (it sends itself SIGKILL) while serving an
rpc_async of rank 0 (a 60 s RPC timeout); rank 0 has opened two distributed autograd contexts
(one reaching ranks 1 and 2, one reaching rank 1 only) and holds an RRef owned by rank 2.
MODE backward: rank 2 calls os._exit(9) in its part of rank 0's dist_autograd.backward (a
tensor hook). Rank 1 only serves, parked in rpc.shutdown(). Rank 2 writes OUT_DIR/killed.json
(the time) just before it dies. The survivors print one line per check, "CHECK name: ..."
(rank 0) and "SHUTDOWN rank R ..." (each survivor), which the test reads.
"""

import json
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

import hpcgrad
from hpcgrad.distributed import autograd as dist_autograd
from hpcgrad.distributed import rpc

MODE, OUT = sys.argv[1], sys.argv[2]
RPC_TIMEOUT = 60.0
rank = MPI.COMM_WORLD.Get_rank()
serving = threading.Event()  # rank 2: the long call arrived


def long_call():
    serving.set()
    time.sleep(RPC_TIMEOUT)
    return "too late"


def echo(x):
    return x


def scale(x):
    return x * 2.0


def die():
    with open(os.path.join(OUT, "killed.json"), "w") as f:
        json.dump({"time": time.time()}, f)
    if MODE == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(9)


def dies_in_backward(x):
    y = x * 2.0
    y.register_hook(lambda grad: die())
    return y


def since_death(failed_at):
    with open(os.path.join(OUT, "killed.json")) as f:
        return f"{failed_at - json.load(f)['time']:.3f}"


def contexts_here():
    return dist_autograd._get_debug_info()["num_autograd_contexts"]


def check(name, text):
    print(f"CHECK {name}: {text}", flush=True)


rpc.init_rpc(f"worker{rank}",
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT))

if rank == 2 and MODE != "backward":
    serving.wait(RPC_TIMEOUT)
    time.sleep(0.2)  # rank 0 is waiting for the reply by now
    die()


def refused_calls():
    """Rank 0, after the death: a new call to rank 2 fails at once; rank 1 still answers."""
    started = time.monotonic()
    try:
        rpc.rpc_sync("worker2", echo, args=(1,))
        check("new_sync", "no error")
    except Exception as error:  # noqa: BLE001
        check("new_sync", f"{type(error).__name__} in {time.monotonic() - started:.3f} s: "
                          f"{error}")
    check("worker1", rpc.rpc_sync("worker1", echo, args=("still here",)))


if rank == 0 and MODE == "backward":
    x = hpcgrad.ones(4, requires_grad=True)
    with dist_autograd.context() as ctx:
        loss = (rpc.rpc_sync("worker1", scale, args=(x,))
                + rpc.rpc_sync("worker2", dies_in_backward, args=(x,))).sum()
        started = time.monotonic()
        try:
            dist_autograd.backward(ctx, [loss])
            check("backward_running", "no error")
        except Exception as error:  # noqa: BLE001
            check("pending_seconds", since_death(time.time()))
            check("backward_running", f"{type(error).__name__} in "
                                      f"{time.monotonic() - started:.3f} s: {error}")
        check("contexts", f"1 -> {contexts_here()}")
        refused_calls()
        check("rank1_contexts", rpc.rpc_sync("worker1", contexts_here))

if rank == 0 and MODE != "backward":
    x = hpcgrad.ones(4, requires_grad=True)
    other, other_ready, other_done = {}, threading.Event(), threading.Event()

    def only_rank1():  # a context that reached rank 1 only: it must stay
        with dist_autograd.context() as ctx:
            rpc.rpc_sync("worker1", scale, args=(x,))
            other_ready.set()
            other_done.wait(RPC_TIMEOUT)
            try:
                dist_autograd.get_gradients(ctx)
                other["alive"] = "alive"
            except Exception as error:  # noqa: BLE001  (printed for the test)
                other["alive"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=only_rank1)
    thread.start()
    other_ready.wait(RPC_TIMEOUT)
    rref = rpc.remote("worker2", echo, args=(7,))
    check("rref_before", rref.to_here())
    with dist_autograd.context() as ctx:
        loss = (rpc.rpc_sync("worker1", scale, args=(x,))
                + rpc.rpc_sync("worker2", scale, args=(x,))).sum()
        before = contexts_here()
        future = rpc.rpc_async("worker2", long_call)
        try:
            future.wait()
            check("pending", "no error")
        except Exception as error:  # noqa: BLE001
            check("pending_seconds", since_death(time.time()))
            check("pending", f"{type(error).__name__}: {error}")
        refused_calls()
        started = time.monotonic()
        try:
            rref.to_here()
            check("rref", "no error")
        except Exception as error:  # noqa: BLE001
            check("rref", f"{type(error).__name__} in {time.monotonic() - started:.3f} s: "
                          f"{error}")
        started = time.monotonic()
        try:
            dist_autograd.backward(ctx, [loss])
            check("backward", "no error")
        except Exception as error:  # noqa: BLE001
            check("backward", f"{type(error).__name__} in {time.monotonic() - started:.3f} s: "
                              f"{error}")
        check("contexts", f"{before} -> {contexts_here()}")
        check("rank1_contexts", rpc.rpc_sync("worker1", contexts_here))
    other_done.set()
    thread.join()
    check("other_context", other["alive"])

started = time.monotonic()
rpc.shutdown()
print(f"SHUTDOWN rank {rank} in {time.monotonic() - started:.3f} s", flush=True)
