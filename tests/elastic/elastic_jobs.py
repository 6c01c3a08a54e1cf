"""The fault-tolerant MPI for tests: .venv-ft (tests/ft_env.sh) and the ULFM launch line.

The elastic tests run from any venv (the default one's pytest included) and start their jobs
with .venv-ft's mpirun and Python, so the default suite needs no Open MPI: without .venv-ft
each test skips and says how to build it. FT_VENV names another venv.
"""

import os
from pathlib import Path

import pytest

from launching import run_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Open MPI as root, more ranks than cores, ULFM on, the transport ULFM supports here
# (Note [Process failures under ULFM] in hpcgrad/comm/ulfm.py).
ULFM_ARGS = ("--oversubscribe", "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "pml",
             "ob1")
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def ft_venv():
    """The fault-tolerant venv: $FT_VENV (relative to the checkout), else .venv-ft."""
    return ROOT / os.environ.get("FT_VENV", ".venv-ft")


def ft_bin(name):
    """.venv-ft/bin/NAME, or skip the test saying how to get it."""
    path = ft_venv() / "bin" / name
    if not path.exists():
        pytest.skip(f"no fault-tolerant MPI: {path} is missing; build it with tests/ft_env.sh "
                    f"(the ft extra, Open MPI with ULFM, in a venv of its own)")
    return str(path)


def run_ft_job(script, nprocs, args=(), env=None, timeout=120):
    """Run tests/elastic/scripts/SCRIPT on ``nprocs`` ranks under the ULFM launch line, with
    .venv-ft's Python; killed after ``timeout`` s (mpirun's own --timeout a little before)."""
    mpirun, python = ft_bin("mpirun"), ft_bin("python")
    full_env = {**ROOT_ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    argv = [mpirun, *ULFM_ARGS, "--timeout", str(max(1, timeout - 10)), "-n", str(nprocs),
            python, str(SCRIPTS / script), *map(str, args)]
    return run_job(argv, nprocs=None, env=full_env, timeout=timeout)
