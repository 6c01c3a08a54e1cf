"""The simulated cluster: namespaces up and down, and an MPI job across 2 nodes x 2 ranks over the network."""

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster as simcluster  # tests/cluster/cluster.py (pytest puts this directory on sys.path)
import pytest

from hpcgrad.comm.mpi import comm_world

_CAN, _WHY = simcluster.can_make_namespaces()
pytestmark = [pytest.mark.skipif(not _CAN, reason=_WHY),
              # every rank would build its own cluster and see the others' namespaces come and go
              pytest.mark.skipif(comm_world().Get_size() > 1, reason="builds its own cluster; runs in the serial suite")]

# Each rank: its node's hostname, the sum of (rank + 1) over ranks, its node's rank count, and a
# 1 MB all-reduce so that bytes must cross the nodes' links.
_JOB = """
import socket
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
total = world.allreduce(world.Get_rank() + 1)
local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
big = np.full(262144, world.Get_rank() + 1, dtype=np.float32)
world.Allreduce(MPI.IN_PLACE, big)
print(f"rank {world.Get_rank()} host {socket.gethostname()} sum {total} local {local} big {int(big[0])}", flush=True)
"""


def _rx_bytes(link):
    return int(Path(f"/sys/class/net/{link}/statistics/rx_bytes").read_text())


def assert_gone(names):
    """None of ``names`` (this test's namespaces) exists: others' clusters may come and go meanwhile."""
    left = set(simcluster.namespaces()) & set(names)
    assert not left, f"the cluster left namespaces {left} behind"


def test_up_down():
    with simcluster.Cluster(2, rate="1gbit") as cl:
        names = set(simcluster.namespaces())
        assert {cl.netns(1), cl.netns(2)} <= names
        hosts = cl.hosts_file.read_text().split()
        assert hosts[:2] == [cl.address(1), "node1"]
        # node1 reaches node2 over the bridge, and sees its own hostname in a fresh UTS namespace
        out = subprocess.run([str(simcluster.LAUNCHER), "-x", cl.address(1),
                              (f"{sys.executable} -c \"import socket; print(socket.gethostname()); "
                               f"socket.create_connection(('{cl.address(2)}', 9), timeout=2)\"")],
                             env={"HPCGRAD_CLUSTER_HOSTS": str(cl.hosts_file), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                             check=False, capture_output=True, text=True, timeout=20)
        assert out.stdout.strip() == "node1"
        assert "ConnectionRefused" in out.stderr  # node2 answered (no listener on port 9): the route works
        tbf = subprocess.run(["tc", "qdisc", "show", "dev", f"hgc{cl.id}n1"], check=False, capture_output=True,
                             text=True, timeout=20).stdout
        assert "tbf" in tbf and "1Gbit" in tbf
        directory = cl.directory
    assert_gone([cl.netns(1), cl.netns(2)])
    assert not directory.exists()
    assert not Path(f"/sys/class/net/{cl.bridge}").exists()


def test_mpi_two_nodes_two_ranks(launch):
    with simcluster.Cluster(2) as cl:
        before = _rx_bytes(f"hgc{cl.id}n1")
        result = launch(cl.mpiexec_argv(4, [sys.executable, "-c", _JOB]),
                        env={**cl.mpi_env(), "MPIEXEC_TIMEOUT": "20"}, timeout=25)
        crossed = _rx_bytes(f"hgc{cl.id}n1") - before
    assert_gone([cl.netns(1), cl.netns(2)])
    assert not result.failed, result.output
    lines = sorted(re.findall(r"rank (\d) host (\S+) sum (\d+) local (\d) big (\d+)", result.stdout))
    # ranks 0, 1 on node1 and 2, 3 on node2 (hydra fills hosts in order); 1+2+3+4 = 10
    assert lines == [("0", "node1", "10", "2", "10"), ("1", "node1", "10", "2", "10"),
                     ("2", "node2", "10", "2", "10"), ("3", "node2", "10", "2", "10")], result.output
    # node1's ranks' data went over its link (Note [MPI across namespaces]: UCX would use shared memory)
    assert crossed > 1_000_000, f"only {crossed} bytes reached node1 over its link"


def test_run_cleans_up_on_sigterm():
    """`cluster.py run` killed mid-job ends the job and removes its namespaces within seconds."""
    before = set(simcluster.namespaces())
    proc = subprocess.Popen([sys.executable, str(Path(simcluster.__file__)), "run", "-n", "2", "--nodes", "2",
                             "--timeout", "30", "--", "sleep", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 15
        while len(ranks := _sleeps_in(before)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == -signal.SIGTERM
    assert_gone(ranks.values())  # the job's nodes: those its ranks ran in
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()
             and b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert not alive, f"the job's ranks {alive} outlived cluster.py"


def _sleeps_in(before):
    """{pid: namespace} of processes running `sleep 30` in namespaces that were not there before
    (the job's ranks)."""
    found = {}
    for ns in set(simcluster.namespaces()) - before:
        pids = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True,
                              timeout=10).stdout.split()
        for pid in pids:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                    found[pid] = ns
    return found
