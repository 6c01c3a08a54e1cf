"""Bounded job launching for tests: mpiexec found and configured for either MPI, orphaned shared memory removed.

Tests import it as ``launching`` (pytest puts tests/ on sys.path through tests/conftest.py); a
module of its own, not ``import conftest``, which names whichever conftest.py was imported first.
"""

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Variables through which a launcher tells a process its rank; a nested mpiexec must not inherit them.
_LAUNCH_ENV_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCAL", "OMPI_COMM_WORLD_")
_SHM_PREFIXES = ("mpich_shm_", "sm_segment.")  # MPICH, Open MPI


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
