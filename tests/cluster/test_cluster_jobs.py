"""The main job and DDP on the simulated cluster (2 nodes x 2 ranks) against single-process training; a rank that dies on one node ends the job everywhere."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cluster as simcluster  # tests/cluster/cluster.py (pytest puts this directory on sys.path)
import ddp_job  # tests/cluster/ddp_job.py: its model and batches make the single-process reference
import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.comm.mpi import comm_world

_CAN, _WHY = simcluster.can_make_namespaces()
pytestmark = [pytest.mark.skipif(not _CAN, reason=_WHY),
              # every rank would build its own cluster and see the others' namespaces come and go
              pytest.mark.skipif(comm_world().Get_size() > 1, reason="builds its own cluster; runs in the serial suite")]

ROOT = Path(__file__).resolve().parents[2]
TRAIN_DDP = ROOT / "jobs" / "train_ddp.py"
DDP_JOB = Path(ddp_job.__file__).resolve()
NODES, PER_NODE = 2, 2
RANKS = NODES * PER_NODE
JOB_TIMEOUT = 60  # MPIEXEC_TIMEOUT of each job; a failed rank must end its job far sooner
ENDED_WITHIN = 10  # seconds from a rank's failure to the end of the whole job (observed: < 1 s)


@pytest.fixture
def cl():
    """A 2-node cluster; the test fails if any of its namespaces outlives it."""
    with simcluster.Cluster(NODES) as built:
        yield built
    left = set(simcluster.namespaces()) & {built.netns(i) for i in range(1, NODES + 1)}
    assert not left, f"the cluster left namespaces {left} behind"


def on_cluster(launch, cl, argv):
    """Run argv on 2 nodes x 2 ranks (mpiexec through the cluster's launcher), bounded."""
    return launch(cl.mpiexec_argv(RANKS, [sys.executable, *map(str, argv)]),
                  env={**cl.mpi_env(), "MPIEXEC_TIMEOUT": str(JOB_TIMEOUT)}, timeout=JOB_TIMEOUT + 10)


def ranks_and_hosts(stdout):
    """{rank: (host, pid)} from ddp_job.py's first line on each rank."""
    return {int(r): (host, int(pid)) for r, host, pid in re.findall(r"rank (\d+) host (\S+) pid (\d+)",
                                                                      stdout)}


def rx_bytes(cl, i):
    """Bytes node i has sent over its link so far (received by its veth end on the bridge)."""
    return int(Path(f"/sys/class/net/hgc{cl.id}n{i}/statistics/rx_bytes").read_text())


# --- the main job ----------------------------------------------------------------------------
# Why one process with --batch-size 128 is the same training as 4 ranks x 32: DistributedSampler
# gives rank r the positions r, r + 4, r + 8, ... of the epoch's seeded permutation, so step k's
# 4 x 32 samples are positions 128 k .. 128 k + 127, the 1-rank run's batch k; DDP averages the 4
# per-rank mean gradients, equal to the mean over the 128. The 1438 digits make 11 such batches
# (the padding to 1440 joins only the 12th): TRAIN_STEPS <= 11.
TRAIN_STEPS = 8
# float32: the runs differ only in the order of summation (4 means averaged vs one mean), about
# one rounding per step; observed max |difference| 3e-8 on parameters of order 0.1 after 10 steps.
TRAIN_TOL = 1e-6


def load_train_ddp():
    """jobs/train_ddp.py as a module, for its build_model (its main() does not run)."""
    if str(TRAIN_DDP.parent) not in sys.path:
        sys.path.insert(0, str(TRAIN_DDP.parent))  # it imports job_args as a sibling
    spec = importlib.util.spec_from_file_location("job_train_ddp", TRAIN_DDP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_arrays(path):
    with np.load(path) as f:
        return {k.removeprefix("model/module."): f[k] for k in f.files if k.startswith("model/")}


def test_train_ddp_on_two_nodes_equals_one_process(launch, cl, tmp_path):
    pytest.importorskip("sklearn")
    common = ["--epochs", "1", "--max-steps", str(TRAIN_STEPS), "--checkpoint-every", "0", "--no-progress"]
    spread = on_cluster(launch, cl, [TRAIN_DDP, "--checkpoint-dir", tmp_path / "cluster", "--batch-size", "32",
                                     *common])
    assert not spread.failed, spread.output
    assert "4 ranks on 2 nodes" in spread.stdout and "global batch 128 (32 per rank)" in spread.stdout, \
        spread.stdout
    single = launch([sys.executable, str(TRAIN_DDP), "--checkpoint-dir", str(tmp_path / "single"),
                     "--batch-size", "128", *common], timeout=JOB_TIMEOUT)
    assert not single.failed, single.output
    assert "1 rank on 1 node;" in single.stdout and "global batch 128 (128 per rank)" in single.stdout
    got, want = model_arrays(tmp_path / "cluster" / "last.npz"), model_arrays(tmp_path / "single" / "last.npz")
    assert got.keys() == want.keys() and len(got) == 6
    for name, value in got.items():
        err = np.max(np.abs(value - want[name]))
        assert err <= TRAIN_TOL, f"{name}: 2 nodes x 2 ranks and 1 process differ by {err:.3g} > {TRAIN_TOL}"
    # ...and the steps did move the weights, far more than the tolerance
    hg.manual_seed(0)  # the job's --seed 0
    initial = {name: p.array for name, p in load_train_ddp().build_model("cnn").named_parameters()}
    assert initial.keys() == want.keys()
    assert min(np.max(np.abs(want[k] - initial[k])) for k in want) > 100 * TRAIN_TOL


# --- DDP -------------------------------------------------------------------------------------
DDP_STEPS = 3
# float64, gradients of order 1: DDP and the reference differ only in the order of summation.
DDP_TOL = 1e-12


def reference_params(steps):
    """ddp_job.py's training in one process: the whole global batch, plain SGD by hand."""
    model = ddp_job.make_model()
    for step in range(1, steps + 1):
        x, y = ddp_job.batch(step, RANKS)
        for p in model.parameters():
            p.grad = None
        ddp_job.mse(model(hg.tensor(x)), y).backward()
        for p in model.parameters():
            p.array -= ddp_job.LR * p.grad.array
    return {name: p.array for name, p in model.named_parameters()}


def test_ddp_on_two_nodes_equals_one_process(launch, cl, tmp_path):
    before = rx_bytes(cl, 2)
    result = on_cluster(launch, cl, [DDP_JOB, "--steps", DDP_STEPS, "--out", tmp_path / "params.npz"])
    sent = rx_bytes(cl, 2) - before
    assert not result.failed, result.output
    where = ranks_and_hosts(result.stdout)
    assert {r: host for r, (host, _) in where.items()} == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}, \
        result.output
    want = reference_params(DDP_STEPS)
    with np.load(tmp_path / "params.npz") as f:
        got = {k: f[k] for k in f.files}
    assert got.keys() == want.keys()
    for name, value in got.items():
        err = np.max(np.abs(value - want[name]))
        assert err <= DDP_TOL, f"{name}: DDP on 2 nodes and 1 process differ by {err:.3g} > {DDP_TOL}"
    initial = {name: p.array for name, p in ddp_job.make_model().named_parameters()}
    assert min(np.max(np.abs(want[k] - initial[k])) for k in want) > 1e-6
    # Node1's ranks end each step with node2's share of the gradient sum, a float64 per parameter
    # that node1 cannot compute itself, so at least that many bytes left node2 over its link.
    gradient_bytes = sum(a.nbytes for a in want.values())
    assert sent >= DDP_STEPS * gradient_bytes, \
        f"only {sent} bytes left node2 for {DDP_STEPS} all-reduces of {gradient_bytes} bytes"


# --- a rank that dies on node2 -----------------------------------------------------------------
def pids_in(cl, i):
    out = subprocess.run(["ip", "netns", "pids", cl.netns(i)], check=False, capture_output=True, text=True,
                         timeout=10).stdout
    return {int(pid) for pid in out.split()}


def rank_pid_on(cl, node, rank, marker, deadline):
    """The pid of ddp_job.py's rank ``rank`` (its command line names ``marker``) in node ``node``."""
    while time.monotonic() < deadline:
        for pid in pids_in(cl, node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(DDP_JOB).encode() in cmdline and str(marker).encode() in cmdline \
                    and b"PMI_RANK=%d" % rank in environ:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} of {DDP_JOB} in {cl.netns(node)}")


def fail_one_rank(launch, cl, tmp_path, rank, extra=(), kill=False):
    """Run ddp_job.py for many steps; once ``rank`` (on node2) has made a step, SIGKILL it if
    ``kill`` (else it raises by itself, per ``extra``). Returns (result, pid, seconds from the
    failure to the end of the job); asserts no process is left in either node."""
    ready = tmp_path / "ready"
    outcome = {}
    job = threading.Thread(target=lambda: outcome.update(result=on_cluster(
        launch, cl, [DDP_JOB, "--steps", 100000, "--ready", ready, "--ready-rank", rank, *extra])))
    job.start()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        pid = rank_pid_on(cl, NODES, rank, ready, deadline)
        while not ready.exists():
            assert time.monotonic() < deadline and job.is_alive(), "the job never made a step"
            time.sleep(0.02)
        if kill:
            os.kill(pid, signal.SIGKILL)
            failed_at = time.time()
        else:
            failed_at = ready.stat().st_mtime  # the rank raises at its next step, a forward later
    finally:
        job.join(JOB_TIMEOUT + 20)
    ended = time.time() - failed_at
    result = outcome["result"]
    where = ranks_and_hosts(result.stdout)
    assert len(where) == RANKS and where[rank] == ("node2", pid), result.output

    def left():
        alive = {r: state for r, (_, p) in where.items() if (state := process_state(p)) not in (None, "Z")}
        return alive, pids_in(cl, 1) | pids_in(cl, 2)

    # mpiexec returns once its proxies are gone; the ranks they SIGKILLed may still be exiting
    deadline = time.monotonic() + 3
    while any(left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive, in_nodes = left()
    assert not alive and not in_nodes, (f"ranks {alive} (rank: state) and pids {in_nodes} in the nodes "
                                        f"outlived the job by 3 s")
    return result, pid, ended


def process_state(pid):
    """The state letter of process ``pid`` (R, S, D, Z, ...), None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_sigkilled_rank_ends_the_job_on_all_nodes(launch, cl, tmp_path):
    result, pid, ended = fail_one_rank(launch, cl, tmp_path, rank=2, kill=True)
    assert result.failed and not result.timed_out, result.output
    print(f"the job ended {ended:.2f} s after rank 2 was killed")  # pytest -rP shows it
    assert ended < ENDED_WITHIN, f"the job ran {ended:.1f} s after rank 2 was killed"
    # hydra names the killed process by pid and host; the job's own first line maps the pid to rank 2
    assert re.search(rf"BAD TERMINATION.*\n=\s+PID {pid} RUNNING AT node2\n=\s+EXIT CODE: 9", result.output), \
        result.output
    assert f"rank 2 host node2 pid {pid}" in result.stdout


def test_exception_on_one_rank_ends_the_job_on_all_nodes(launch, cl, tmp_path):
    # rank 3, on node2: hydra's "Abort(1) on node 3 (rank 3 ...)" counts ranks, not our nodes
    result, pid, ended = fail_one_rank(launch, cl, tmp_path, rank=3, extra=["--raise-at", "3:2"])
    assert result.failed and not result.timed_out, result.output
    print(f"the job ended {ended:.2f} s after rank 3's last step before it raised")
    assert ended < ENDED_WITHIN, f"the job ran {ended:.1f} s after rank 3 raised"
    # the abort hook names the rank and its host (hpcgrad.comm.mpi.abort_job)
    assert f"[rank 3] on host node2, pid {pid}:\n[rank 3] uncaught exception -> MPI_Abort" in result.stderr, \
        result.output
    assert "[rank 3] RuntimeError: rank 3 fails at step 2 on purpose" in result.stderr
