"""Test harness: the MPI abort hook, bounded multi-rank tests, GPU skipping and a bounded job launcher."""

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Flight records that failing tests write (Note [Flight recorder]) go to a scratch directory,
# not into the checkout; set before hpcgrad reads it. Launched jobs inherit it.
os.environ.setdefault("HPCGRAD_FLIGHT_DIR", os.path.join(tempfile.gettempdir(), "hpcgrad-flight-tests"))

import hpcgrad.distributed as dist  # noqa: E402
from hpcgrad.comm.mpi import comm_world  # noqa: E402  (under mpiexec, importing installs the abort-on-exception hook)

# Variables through which a launcher tells a process its rank; a nested mpiexec must not inherit them.
_LAUNCH_ENV_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCAL", "OMPI_COMM_WORLD_")
_SHM_PREFIXES = ("mpich_shm_", "sm_segment.")  # MPICH, Open MPI


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads the method
def pytest_configure(config):
    if comm_world().Get_size() > 1 and config.getoption("timeout_method", None) is None:
        config.option.timeout_method = "thread"


# A test that fails on one rank leaves its peers in a collective: they get a CommTimeoutError
# after this long (and report it) instead of hanging until the run's MPIEXEC_TIMEOUT.
GROUP_TIMEOUT = 30


@pytest.fixture
def world():
    """The default process group (init_process_group is idempotent: the first call creates it)."""
    return dist.init_process_group(timeout=GROUP_TIMEOUT)


@pytest.fixture
def group():
    """A fresh communicator per test, with a timeout: a hang fails the test, and whatever a
    failed test left pending stays out of the next one."""
    dist.init_process_group(timeout=GROUP_TIMEOUT)
    g = dist.new_group(timeout=2 * GROUP_TIMEOUT)  # DDP steps at 3 ranks on 2 cores are slow
    yield g
    dist.destroy_process_group(g)


_FOUR_RANK_MODULES = ("test_rpc", "test_dist_autograd")


def _uses_torch(code, depth=0):
    """True when a test's code names torch (a global, ``importorskip("torch")``, ``torch_or_skip``)."""
    names = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
    if names & {"torch", "torch_or_skip"}:
        return True
    return depth < 2 and any(_uses_torch(c, depth + 1) for c in code.co_consts
                             if hasattr(c, "co_names"))


def pytest_collection_modifyitems(config, items):
    # Count the tests that compare with PyTorch itself, so the summary can say how many ran.
    for item in items:
        code = getattr(getattr(item, "obj", None), "__code__", None)
        if code is not None and (_uses_torch(code)
                                 or getattr(getattr(item, "module", None), "torch", None) is not None):
            item.add_marker("torch_reference")
    # RPC and distributed autograd also run at 4 ranks (PyTorch's tests use world size 4).
    for item in items:
        if item.path.name.startswith(_FOUR_RANK_MODULES):
            item.add_marker("four_ranks")
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # importing cupy only to skip nothing would cost seconds
    from hpcgrad.info import gpu_count
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU: cupy is missing or cupy.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


def mpiexec_path():
    """The mpiexec beside this Python (the venv's, matching its mpi4py), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@functools.lru_cache(maxsize=None)
def mpiexec_options(mpiexec):
    """(arguments, environment) a launcher needs here: Open MPI refuses root and more ranks than
    cores unless told (tests/run.sh does the same); MPICH's hydra needs nothing."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.lower()
    except (OSError, subprocess.SubprocessError):
        return (), {}
    if any(name in version for name in ("open mpi", "open-mpi", "openrte", "prte")):
        return ("--oversubscribe",), {"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return (), {}


def _shm_files():
    try:
        return {entry.path for entry in os.scandir("/dev/shm") if entry.name.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


def _remove_orphaned_shm(before, grace=2.0):
    """Delete shared-memory files a killed or aborted job left behind (MPICH leaks 2 MB per MPI_Abort).

    Only files created during the job and mapped by no live process are removed; ranks that
    mpiexec is still killing get `grace` seconds to let go of theirs.
    """
    pending = _shm_files() - before
    deadline = time.monotonic() + grace
    while pending:
        mapped = set()
        for maps in Path("/proc").glob("[0-9]*/maps"):
            with contextlib.suppress(OSError):  # the process may end while we look
                text = maps.read_text()
                mapped |= {path for path in pending if path in text}
        for path in pending - mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)
        pending = mapped
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def output(self):
        return self.stdout + self.stderr

    @property
    def timed_out(self):
        # MPICH's hydra may exit 0 after MPIEXEC_TIMEOUT kills a hung job; its banner is the reliable sign.
        return self.returncode is None or "APPLICATION TIMED OUT" in self.output

    @property
    def failed(self):
        return self.returncode != 0 or self.timed_out


def run_job(argv, nprocs=None, env=None, timeout=60, mpiexec_timeout=None):
    """Run argv (under `mpiexec -n nprocs` unless nprocs is None), killed after `timeout` seconds.

    mpiexec_timeout sets MPICH's MPIEXEC_TIMEOUT (default: timeout). returncode is None if the
    outer timeout had to kill the job.
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV_PREFIXES)}
    full_env.update(env or {})
    if nprocs is not None:
        mpiexec = mpiexec_path()
        if mpiexec is None:
            pytest.skip("mpiexec not found beside python or on PATH")
        full_env["MPIEXEC_TIMEOUT"] = str(mpiexec_timeout or timeout)
        extra_args, extra_env = mpiexec_options(mpiexec)
        full_env.update(extra_env)
        argv = [mpiexec, *extra_args, "-n", str(nprocs), *argv]
    shm_before = _shm_files()
    start = time.monotonic()
    # A new session lets the outer timeout kill mpiexec and its proxies in one go; the ranks (hydra
    # gives each its own session) die with their proxy.
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
    elapsed = time.monotonic() - start
    _remove_orphaned_shm(shm_before)
    return JobResult(returncode, stdout, stderr, elapsed)


@pytest.fixture
def launch():
    """run_job, for tests that start their own processes; skipped inside a multi-rank run (it would run once per rank)."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    return run_job


_torch_outcomes = {}


def pytest_runtest_logreport(report):
    if "torch_reference" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _torch_outcomes.setdefault(report.nodeid, report.outcome)


def pytest_terminal_summary(terminalreporter):
    """One line: how many PyTorch-comparison tests ran here (CI installs torch 2.13.0 CPU)."""
    if not _torch_outcomes:
        return
    counts = {}
    for outcome in _torch_outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    try:
        import torch
        have = f"torch {torch.__version__}"
    except ImportError:
        have = "torch not installed: pip install -e '.[reference]'"
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    terminalreporter.write_line(f"PyTorch reference tests ({have}): {len(_torch_outcomes)} "
                                f"compared with PyTorch: {detail}")
