"""DDP with the progress thread: a bucket's all-reduce completes while backward computes in Python, on one host and across simulated nodes."""

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.autograd.function import Function
from hpcgrad.comm.mpi import comm_world
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
IN, HIDDEN, OUT = 512, 512, 512  # 1 MB weights, no biases: a bucket each, the last first
SPIN_LIMIT = 20.0  # seconds backward may compute while it waits for the first bucket


class Spin(Function):
    """Identity whose backward computes in Python (holding the GIL between the interpreter's
    switches, never calling MPI) until the first bucket's all-reduce has completed or
    SPIN_LIMIT has passed; it records which, and how long it spun."""

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.array.copy()

    @staticmethod
    def backward(ctx, g):
        probe = ctx.probe
        work = probe["reducer"].buckets[0].work  # launched by the hook before this runs
        start = time.monotonic()
        acc = 0
        while not work._completed and time.monotonic() - start < SPIN_LIMIT:
            for i in range(2000):  # pure Python: the GIL is taken back only at switches
                acc += i * i
        probe["completed_in_backward"] = work._completed
        probe["spun"] = time.monotonic() - start
        return hg.Tensor(g.array.copy()), None


class Net(nn.Module):
    def __init__(self, probe):
        super().__init__()
        self.first, self.last = nn.Linear(IN, HIDDEN, bias=False), nn.Linear(HIDDEN, OUT, bias=False)
        self.probe = probe

    def forward(self, x):
        return self.last(Spin.apply(self.first(x), self.probe))


def _batch(rank):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((4, IN)).astype(np.float32)


def check_bucket_completes_during_backward(group, start_thread=True):
    """One DDP step with the progress thread on: the last layer's bucket (launched first) must
    complete while Spin's backward computes, and the averaged gradients must be those of the
    whole batch computed on one process. ``start_thread=False``: DDP must have started the
    thread itself (a group spanning nodes, Note [Progress across nodes])."""
    probe = {}
    hg.manual_seed(0)
    model = Net(probe)
    reference = [p.array.copy() for p in model.parameters()]
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.5)
    probe["reducer"] = ddp.reducer
    assert [b.variables[0] for b in ddp.reducer.buckets] == [model.last.weight,
                                                            model.first.weight]
    rank, size = group.rank(), group.size()
    if start_thread:
        dist.start_progress_thread(interval=2e-4)
    else:
        assert ddp.nodes > 1 and dist.progress_thread() is not None, (
            f"DDP over {ddp.nodes} node(s) did not start the progress thread")
    try:
        ddp(hg.tensor(_batch(rank))).sum().backward()
    finally:
        dist.stop_progress_thread()
    assert probe["completed_in_backward"], (
        f"rank {rank}: the first bucket's all-reduce did not complete within {SPIN_LIMIT} s of "
        "backward computing in Python (the progress thread did not progress it)")
    # Reference: the same model, on the whole batch, in this process alone.
    local = Net({})
    for p, value in zip(local.parameters(), reference):
        p.array[...] = value
    with _no_spin():
        for r in range(size):
            local(hg.tensor(_batch(r))).sum().backward()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        np.testing.assert_allclose(p.grad.array, q.grad.array / size, rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    return probe["spun"]


class _no_spin:
    """Spin's backward without a DDP bucket to wait for: returns at once."""

    def __enter__(self):
        self.saved = Spin.backward
        Spin.backward = staticmethod(lambda ctx, g: (hg.Tensor(g.array.copy()), None))

    def __exit__(self, *exc):
        Spin.backward = self.saved


@pytest.mark.mpi(min_size=2)
def test_bucket_completes_during_backward(group):
    check_bucket_completes_during_backward(group)


@pytest.mark.mpi(min_size=2)
def test_one_node_leaves_the_thread_off(group, monkeypatch):
    """On one host DDP starts no thread (every core computes; Note [Communication
    progress]); HPCGRAD_PROGRESS_THREAD=0 keeps it off across nodes too."""
    from hpcgrad.comm import progress
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    dist.stop_progress_thread()
    ddp = DDP(nn.Linear(4, 4), process_group=group)
    assert ddp.nodes == 1
    assert dist.progress_thread() is None
    assert progress.start_for_nodes(2) is not None  # what DDP does across nodes
    dist.stop_progress_thread()
    assert progress.start_for_nodes(2, ranks_here=3, cores=2) is None  # oversubscribed
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")  # mpirun --with-ft ulfm: elastic jobs
    assert progress.start_for_nodes(2) is None
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")  # asked for all the same
    assert progress.start_for_nodes(2) is not None
    dist.stop_progress_thread()
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable")
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert progress.start_for_nodes(2) is None
    monkeypatch.setenv(progress.PROGRESS_ENV, "sometimes")
    with pytest.raises(ValueError, match="HPCGRAD_PROGRESS_THREAD must be 0 or 1, got "
                                         "'sometimes' \\(or auto"):
        progress.start_for_nodes(2)


_CLUSTER = HERE.parent / "cluster"


def _cluster_or_skip():
    if comm_world().Get_size() > 1:
        pytest.skip("builds its own cluster; runs in the serial suite")
    sys.path.insert(0, str(_CLUSTER))
    import cluster as simcluster
    can, why = simcluster.can_make_namespaces()
    if not can:
        pytest.skip(why)
    return simcluster


@pytest.mark.timeout(150)
def test_bucket_completes_during_backward_across_nodes():
    """2 nodes x 1 rank on a 1gbit link, over ofi/tcp: DDP starts the progress thread itself
    (HPCGRAD_PROGRESS_THREAD unset), and the all-reduce crosses the network while backward
    computes in Python, progressed by the thread alone."""
    simcluster = _cluster_or_skip()
    import subprocess
    with simcluster.Cluster(2, rate="1gbit") as cluster:
        env = {**os.environ, **cluster.mpi_env(), "MPIEXEC_TIMEOUT": "100"}
        env.pop("HPCGRAD_PROGRESS_THREAD", None)
        proc = subprocess.run(cluster.mpiexec_argv(2, [sys.executable, __file__]), env=env,
                              capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("completed during backward") == 2, proc.stdout


if __name__ == "__main__":  # a rank of the cluster test's job
    dist.init_process_group(timeout=60)
    spun = check_bucket_completes_during_backward(dist.new_group(timeout=60), start_thread=False)
    print(f"rank {dist.get_rank()}: completed during backward after {spun * 1e3:.1f} ms",
          flush=True)
