"""``torch.multiprocessing`` for MPI jobs: ``spawn(fn, args, nprocs)`` runs ``fn(rank, *args)`` on each MPI rank.

Note [spawn over MPI]
PyTorch's examples start their workers with ``mp.spawn(run_worker, args=(world,),
nprocs=world)``: the parent forks ``nprocs`` children, child ``i`` calls ``run_worker(i,
world)``, and the parent waits. Forking after MPI started is unsafe, so here the ranks are MPI
processes and the script runs unchanged in two ways:

- under ``mpiexec -n N`` (or ``srun``), ``spawn(fn, args, nprocs=N)`` calls ``fn(rank, *args)``
  on every rank and returns (``nprocs`` must be the world size: the error says how to launch);
- as ``python script.py`` (no launcher), ``spawn`` starts ``mpiexec -n nprocs`` on the same
  script and arguments, waits, and raises ``ProcessExitedException`` if a rank failed; in
  that job each rank leaves right after ``fn`` returns, so, as with PyTorch's children, only
  the parent runs the code after ``spawn``. Everything before ``spawn`` in the script runs in
  the parent and again in every rank, as it does in PyTorch's spawned children (which import
  the main module); a script that guards its start with ``if __name__ == "__main__"`` gets
  that behaviour from both.
Everything else is Python's own ``multiprocessing`` (``Process``, ``Queue``,
``set_start_method`` ...), as ``torch.multiprocessing`` re-exports it.
"""

import os
import shutil
import subprocess
import sys
from multiprocessing import *  # noqa: F401,F403  (torch.multiprocessing re-exports it too)

from hpcgrad.base import config

_SPAWNED = "HPCGRAD_SPAWNED"  # set in the ranks of a job that spawn() started
# (rank, size) variables of the launchers, checked in order; no MPI call is needed to read them.
_LAUNCH_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCAL", "OMPI_COMM_WORLD_")


class ProcessExitedException(Exception):
    """A rank of the job ``spawn`` started ended with a nonzero status (PyTorch's name)."""

    def __init__(self, msg, error_index=-1, error_pid=-1, exit_code=1, signal_name=None):
        super().__init__(msg)
        self.error_index, self.pid, self.exit_code = error_index, error_pid, exit_code
        self.signal_name = signal_name


class ProcessContext:
    """What ``spawn(..., join=False)`` returns: here every rank has already run ``fn``."""

    def join(self, timeout=None):
        return True


def _launched():
    """(rank, size) from the launcher's environment, or None outside mpiexec/srun."""
    for rank_var, size_var in _LAUNCH_VARS:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return None


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """Run ``fn(rank, *args)`` on ``nprocs`` MPI ranks (Note [spawn over MPI])."""
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    launched = _launched()
    if launched is None and nprocs == 1:
        launched = (0, 1)
    if launched is None:
        _run_job(nprocs)
        return None if join else ProcessContext()
    rank, size = launched
    if size != nprocs:
        raise ValueError(f"spawn(nprocs={nprocs}) in a job of {size} MPI ranks: the ranks are "
                         f"the processes here, so launch with mpiexec -n {nprocs} (or run the "
                         f"script with plain python and spawn starts them)")
    fn(rank, *args)
    if config.raw(_SPAWNED):  # a rank of the job below: only the parent goes on
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(0)
    return None if join else ProcessContext()


def _mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("spawn: no mpiexec beside this Python or on PATH, so the ranks "
                           "cannot be started; pip install 'hpcgrad[mpich]' or load your MPI")
    return found


def _run_job(nprocs):
    """``mpiexec -n nprocs`` on this script and its arguments; raise if a rank failed."""
    mpiexec = _mpiexec()
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    options = ["--oversubscribe"] if "open" in version.lower() else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env[_SPAWNED] = "1"
    if "open" in version.lower():
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None:
        raise RuntimeError("spawn: the ranks rerun this script, but __main__ has no file "
                           "(an interactive session or python -c); save it as a script, or "
                           "launch with mpiexec -n N python script.py")
    command = [mpiexec, *options, "-n", str(nprocs), sys.executable, script, *sys.argv[1:]]
    status = subprocess.run(command, env=env).returncode
    if status != 0:
        raise ProcessExitedException(f"process terminated with exit code {status} (a rank "
                                     f"of: {' '.join(command)})", exit_code=status)
