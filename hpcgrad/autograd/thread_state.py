"""Per-thread engine state: which device queue a thread serves, reentrant depth, current GraphTask."""

import threading

NO_DEVICE = -2
CPU_DEVICE = -1


class _ThreadState(threading.local):
    worker_device = NO_DEVICE   # CPU_DEVICE while this thread runs backward work
    current_depth = 0           # nested reentrant backwards on this thread
    total_depth = 0             # reentrant depth of the GraphTask this thread works on
    current_graph_task = None   # what queue_callback appends to
    local_ready_queue = None


_tls = _ThreadState()
