#!/bin/bash
# The elastic tests with the fault-tolerant MPI: builds .venv-ft if it is missing (tests/ft_env.sh),
# then runs tests/elastic with the default venv's pytest; the multi-rank jobs inside start with
# .venv-ft's mpirun under the ULFM launch line (tests/elastic/elastic_jobs.py).
#
#     tests/elastic/run.sh            # ~75-90 s on 2 cores once .venv-ft exists (+42 s to build it)
#     tests/elastic/run.sh -s         # pytest options pass through; -s prints kill -> first step
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${FT_VENV:-.venv-ft}
[ -x "$venv/bin/mpirun" ] || tests/ft_env.sh
python=${PYTHON:-.venv/bin/python}
exec timeout -k 10 600 "$python" -m pytest tests/elastic -q "$@"
