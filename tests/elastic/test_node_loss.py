"""A simulated node lost under ULFM: 2 nodes x 2 ranks of the namespace cluster (tests/cluster)
under Open MPI's mpirun, node2's processes killed with SIGKILL; the survivors on node1 must
finish on 2 ranks, equal bit for bit to a run told in advance to drop ranks 2 and 3
(scripts/node_train.py).

Note [A lost node under Open MPI 5.0.11]
    Killing node2's two ranks while its Open MPI daemon (prted) lives on is survived like any
    lost rank. Killing the whole node, prted included, ends the whole job: mpirun's runtime
    (PRRTE 3.0.11 in the wheel) treats a daemon it can no longer reach as fatal whatever
    ``--with-ft ulfm`` or ``--enable-recovery`` say. In its errmgr (src/mca/errmgr/dvm/
    errmgr_dvm.c, proc_errors, the arm for a daemon) a lost connection (COMM_FAILED) or the
    exit of the daemon's launch agent (FAILED_TO_START, from plm/ssh's ssh_wait_daemon: here the
    agent, launcher.sh, dies with the node) logs "Comm failure: daemon [...,2] - aborting",
    prints "PRTE has lost communication with a remote daemon ... We cannot recover from this
    failure" or "A daemon failed to report back after being spawned", and ends the job: node1's
    daemon and the survivors are killed, and mpirun exited 0 both ways here. That arm is the
    same in every PRRTE release up to v3.0.14 and v4.1.1rc2; PRRTE's master changed it after
    them (25f65e001b, "Update proc states when nodes die": the lost node's processes are marked
    terminated and the job goes on; untested here). The wheel has no failure detector either
    (prte_info lists errmgr components dvm and prted only).
    Without a pause after the kill the survivors once finished their last 16 steps (~0.1 s)
    before the runtime reached them, so node_train.py slows the shrunk world's steps. The
    whole-node test runs and, when the runtime ends the job that way, is an expected failure
    naming it; on a runtime that survives it, it checks everything the ranks-only test does.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from elastic_jobs import ROOT, ROOT_ENV, SCRIPTS, ULFM_ARGS, ft_bin
from hpcgrad.comm.mpi import comm_world
from launching import run_job

sys.path.insert(0, str(ROOT / "tests" / "cluster"))
import cluster as simcluster  # noqa: E402  (tests/cluster/cluster.py)

_CAN, _WHY = simcluster.can_make_namespaces()
pytestmark = [pytest.mark.skipif(not _CAN, reason=_WHY),
              pytest.mark.skipif(comm_world().Get_size() > 1,
                                 reason="builds its own cluster; runs in the serial suite")]

NODES, PER_NODE = 2, 2
RANKS = NODES * PER_NODE
VICTIMS = [2, 3]  # node2's ranks (mpirun_argv fills node1 first)
KILL_STEP = 5  # the victims stop at the top of step 5 and wait to be killed
RESTORED = 4  # shrink_train.py commits every 2 steps
JOB_TIMEOUT = 60  # mpirun's --timeout; each job takes 5-10 s here
# Seconds each step on the shrunk world but the first sleeps when the whole node is lost, so that
# the survivors are still training if the runtime ends the job (Note [A lost node under ...]).
PAUSE = 0.2
LOST_DAEMON = ("PRTE has lost communication with a remote daemon",
               "A daemon failed to report back after being spawned")


@pytest.fixture
def cl():
    """A 2-node cluster; whatever is left in its namespaces is killed before they go."""
    ft_bin("mpirun")  # skips without .venv-ft, before any namespace is made
    with simcluster.Cluster(NODES) as built:
        try:
            yield built
        finally:
            for i in range(1, NODES + 1):
                kill_all(pids_in(built, i))
    left = set(simcluster.namespaces()) & {built.netns(i) for i in range(1, NODES + 1)}
    assert not left, f"the cluster left namespaces {left} behind"


def pids_in(cl, i):
    out = subprocess.run(["ip", "netns", "pids", cl.netns(i)], check=False, capture_output=True,
                         text=True, timeout=10).stdout
    return {int(pid) for pid in out.split()}


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ranks_in(cl, i):
    """{pid: world rank} of the job's ranks in node i."""
    found = {}
    for pid in pids_in(cl, i):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
                found[pid] = int(entry.split(b"=")[1])
    return found


def command_name(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def start_job(cl, out, mode, step, pause=0):
    """node_train.py MODE 2,3 STEP on 2 nodes x 2 ranks, in a thread; (thread, outcome).
    ``pause``: seconds each step on the shrunk world sleeps (NODE_TRAIN_PAUSE)."""
    out.mkdir()
    command = [ft_bin("python"), str(SCRIPTS / "node_train.py"), mode,
               ",".join(map(str, VICTIMS)), str(step), str(out), "2"]
    argv = cl.mpirun_argv(RANKS, command, ft_bin("mpirun"),
                          options=(*ULFM_ARGS, "--timeout", str(JOB_TIMEOUT)))
    env = {**ROOT_ENV, "PYTHONPATH": str(ROOT), "NODE_TRAIN_PAUSE": str(pause), **cl.mpirun_env()}
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(
        job=run_job(argv, env=env, timeout=JOB_TIMEOUT + 10)))
    thread.start()
    return thread, outcome


def finish(thread, outcome):
    thread.join(JOB_TIMEOUT + 20)
    job = outcome.get("job")
    assert job is not None and job.returncode is not None, "the job outlived its timeout"
    return job


def lose_node(cl, tmp_path, whole):
    """Run the kill job; once ranks 2 and 3 (node2) wait at KILL_STEP, SIGKILL every process of
    node2 (``whole``) or its ranks only. Returns (out, job, time of the kill, names killed)."""
    out = tmp_path / "lost"
    thread, outcome = start_job(cl, out, "hang", KILL_STEP, pause=PAUSE if whole else 0)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not all((out / f"hung{r}.json").exists() for r in VICTIMS):
            assert time.monotonic() < deadline and thread.is_alive(), \
                f"ranks {VICTIMS} never reached step {KILL_STEP}: {outcome}"
            time.sleep(0.02)
        placed = {i: sorted(ranks_in(cl, i).values()) for i in (1, 2)}
        assert placed == {1: [0, 1], 2: VICTIMS}, f"world ranks per node: {placed}"
        targets = pids_in(cl, 2) if whole else set(ranks_in(cl, 2))
        killed = sorted(command_name(pid) for pid in targets)
        killed_at = time.time()
        kill_all(targets)
        if whole:  # nothing in node2 may outlive the kill (nor start after it)
            while (left := pids_in(cl, 2)) and time.monotonic() < deadline:
                kill_all(left)
                time.sleep(0.02)
            assert not pids_in(cl, 2)
    finally:
        job = finish(thread, outcome)
    return out, job, killed_at, killed


def check_survivors_equal_a_planned_departure(cl, tmp_path, out, job, killed_at):
    """Ranks 0 and 1 saw one change 4 -> 2 naming ranks 2 and 3, went back to step 4 and ended
    equal, bit for bit, to a run on the same cluster that dropped ranks 2 and 3 at step 4."""
    survivors = [0, 1]
    missing = [r for r in survivors if not (out / f"rank{r}.json").exists()]
    assert not missing, f"survivors {missing} did not finish:\n{job.output[-3000:]}"
    info = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    for rank in survivors:
        (change,) = info[rank]["changes"]
        assert (change["old"], change["new"], change["lost"]) == (4, 2, VICTIMS), change
        assert change["restored_step"] == RESTORED and not change["planned"]
        assert info[rank]["size"] == 2
        assert f"[world rank {rank}] WorldChange(4 -> 2 ranks, lost world ranks [2, 3]" \
            in job.stdout, job.output[-3000:]
    assert sorted(info[r]["changes"][0]["rank"] for r in survivors) == survivors
    first = min(info[r]["first_step_after"][0] for r in survivors)
    recovery = max(info[r]["changes"][0]["seconds"] for r in survivors)
    ref_out = tmp_path / "plan"
    ref_job = finish(*start_job(cl, ref_out, "plan", RESTORED))
    for rank in survivors:
        assert (ref_out / f"rank{rank}.json").exists(), ref_job.output[-3000:]
        ref = json.loads((ref_out / f"rank{rank}.json").read_text())
        assert ref["changes"][0]["planned"] and ref["steps"] == info[rank]["steps"]
        got, want = np.load(out / f"rank{rank}.npy"), np.load(ref_out / f"rank{rank}.npy")
        assert np.array_equal(got, want), (
            f"world rank {rank}: parameters differ from the planned run by "
            f"{np.abs(got - want).max()}")
    return f"{first - killed_at:.3f} s (recovery alone {recovery:.3f} s)"


def nothing_left(cl):
    """mpirun has returned; its daemon and ranks on node1 are gone within 5 s."""
    deadline = time.monotonic() + 5
    while (left := pids_in(cl, 1) | pids_in(cl, 2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not left


@pytest.mark.slow
@pytest.mark.timeout(240)  # two jobs of 5-10 s each (60 s at most), on a loaded 2-core machine
def test_ranks_of_a_node_killed_equal_a_planned_departure(cl, tmp_path):
    """Node2's two ranks are SIGKILLed (its prted lives on): ULFM across the bridge, real TCP."""
    out, job, killed_at, killed = lose_node(cl, tmp_path, whole=False)
    assert killed == ["python", "python"], killed
    took = check_survivors_equal_a_planned_departure(cl, tmp_path, out, job, killed_at)
    print(f"\nnode2's ranks killed: kill -> first step on the shrunk world: {took}")
    assert nothing_left(cl)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_whole_node_lost_equal_a_planned_departure(cl, tmp_path):
    """Every process of node2, Open MPI's daemon included, is SIGKILLed: a node gone.
    Note [A lost node under Open MPI 5.0.11]: that runtime ends the job (expected failure)."""
    out, job, killed_at, killed = lose_node(cl, tmp_path, whole=True)
    ended = time.time() - killed_at
    assert "prted" in killed and killed.count("python") == 2, killed
    seen = [message for message in LOST_DAEMON if message in job.output]
    if seen and not list(out.glob("rank*.json")):
        assert nothing_left(cl), "the runtime ended the job but left processes in the nodes"
        pytest.xfail(f"Open MPI's runtime ended the whole job when node2's daemon died "
                     f"({ended:.1f} s after the kill, said: {seen[0]!r}); "
                     f"see Note [A lost node under Open MPI 5.0.11]")
    took = check_survivors_equal_a_planned_departure(cl, tmp_path, out, job, killed_at)
    print(f"\nnode2 lost (prted included): kill -> first step on the shrunk world: {took}")
    assert nothing_left(cl)
