#!/usr/bin/env bash
# One command for a GPU machine: install, probe CUDA-aware MPI, GPU tests at 1 and 2 ranks, benchmarks/gpu.py, report.
#
#   bash tests/gpu.sh              # pip install --no-deps -e . into the venv (no index needed)
#   bash tests/gpu.sh WHEEL_DIR    # pip install --no-index --find-links WHEEL_DIR -e . (a machine without network)
#
# The venv (HPCGRAD_GPU_VENV, default .venv-gpu) is made with --system-site-packages from $PYTHON
# (default python3), so the machine's own cupy, numba-cuda, mpi4py and torch serve; it is reused
# when it exists. HPCGRAD_GPU_VENV=none uses $PYTHON as it is, installing nothing.
# Without a GPU it checks that everything imports, prints "no GPU: ..." and exits 0 (CI may call it).
# Every run is bounded: HPCGRAD_GPU_TEST_TIMEOUT (s per test run, default 300),
# HPCGRAD_GPU_BENCH_TIMEOUT (s per benchmark run, default 150). Exit status 1 if any run failed.
set -u
cd "$(dirname "$0")/.."

wheels=${1:-}
venv=${HPCGRAD_GPU_VENV:-.venv-gpu}
base_python=${PYTHON:-python3}
test_limit=${HPCGRAD_GPU_TEST_TIMEOUT:-300}
bench_limit=${HPCGRAD_GPU_BENCH_TIMEOUT:-150}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

die() { echo "tests/gpu.sh: $*" >&2; exit 2; }
[ -z "$wheels" ] || [ -d "$wheels" ] || die "wheel folder '$wheels' does not exist"

# --- the interpreter, and hpcgrad installed into it --------------------------------------------
if [ "$venv" = none ]; then
    python=$base_python
    installed="none (HPCGRAD_GPU_VENV=none: $python as it is)"
else
    if [ ! -x "$venv/bin/python" ]; then
        "$base_python" -m venv --system-site-packages "$venv" || die "cannot make a venv with $base_python"
    fi
    python=$venv/bin/python
    # No build isolation: it would fetch setuptools from an index the machine may not have.
    if [ -n "$wheels" ]; then
        install=(--no-index --find-links "$wheels" --no-build-isolation -e .)
    else
        install=(--no-deps --no-build-isolation -e .)
    fi
    if timeout -k 10 300 "$python" -m pip install -q "${install[@]}" >"$logs/pip.log" 2>&1; then
        installed="pip install ${install[*]} into $venv"
    else
        tail -5 "$logs/pip.log" >&2
        die "pip install ${install[*]} failed (log above); with no index, pass a folder holding the" \
            "missing wheels (pip download --no-deps --only-binary=:all: --python-version 3.12 ...)"
    fi
fi

# --- the test tools: a GPU machine without an index must be given them as wheels ----------------
if [ -n "$wheels" ]; then  # the wheels given may also be the test tools the machine lacks
    timeout -k 10 300 "$python" -m pip install -q --no-index --find-links "$wheels" \
        pytest-mpi pytest-timeout >"$logs/pip-tools.log" 2>&1 || true
fi
missing=$("$python" -c '
import importlib.util as u
print(" ".join(n for m, n in (("pytest", "pytest"), ("pytest_mpi", "pytest-mpi"),
      ("pytest_timeout", "pytest-timeout"), ("mpi4py", "mpi4py")) if u.find_spec(m) is None))')
[ -z "$missing" ] || die "$python lacks $missing; on a machine with an index run: pip download" \
    "--no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64" \
    "--dest wheels $missing mpich, carry the folder, and run: bash tests/gpu.sh wheels"

# --- everything imports, with or without a GPU --------------------------------------------------
imports="import hpcgrad, hpcgrad.cuda, hpcgrad.distributed, hpcgrad.info, hpcgrad.kernels.cuda, hpcgrad.nn.parallel"
timeout -k 5 120 "$python" -c "$imports" || die "importing hpcgrad failed with $python (see above)"
gpus=$(timeout -k 5 120 "$python" -c 'from hpcgrad.info import cupy_status; d, n = cupy_status(); print(n, d)') \
    || die "hpcgrad.info.cupy_status failed with $python"
if [ "${gpus%% *}" = 0 ]; then
    echo "no GPU: cupy ${gpus#* }; everything imports with $python; nothing else to run"
    exit 0
fi

# --- mpiexec beside the interpreter, as tests/run.sh finds it ---------------------------------
py_bin=$("$python" -c 'import os, sys; print(os.path.dirname(sys.executable))')
if [ -n "${MPIEXEC:-}" ]; then mpiexec=$MPIEXEC
elif [ -x "$py_bin/mpiexec" ]; then mpiexec=$py_bin/mpiexec
else mpiexec=$(command -v mpiexec) || die "no mpiexec beside $python or on PATH; install the mpich wheel"
fi
mpiexec_args=()
if "$mpiexec" --version 2>&1 | grep -qiE 'open mpi|open-mpi|openrte|prte'; then
    mpiexec_args=(--oversubscribe --timeout "$test_limit")
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

summary=()
failures=0
runs=0

# run NAME CMD...: CMD's output teed to a log; one summary line with pytest's counts, if any.
run() {
    local name=$1; shift
    local log="$logs/run$runs.log" start=$SECONDS rc verdict counts
    runs=$((runs + 1))
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 5 ] && rc=0  # no tests collected
    # MPICH may exit 0 after MPIEXEC_TIMEOUT kills a hung job; any rank's failures fail the run.
    if grep -q 'APPLICATION TIMED OUT' "$log"; then rc=124; fi
    if [ "$rc" -eq 0 ] && grep -qE '\b[0-9]+ (failed|errors?)\b.* in [0-9.]+s' "$log"; then rc=1; fi
    case $rc in
        0) verdict="passed" ;;
        124|137) verdict="FAILED (timed out)" ;;
        *) verdict="FAILED (status $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || failures=$((failures + 1))
    # pytest's last line per rank ("12 passed, 3 skipped in 4.1s"), ranks that agree counted once.
    counts=$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" \
             | sed -E 's/=//g; s/ in [0-9.]+s.*//; s/^ +//' | sort | uniq -c \
             | awk '{n = $1; sub(/^ *[0-9]+ /, ""); print (n > 1 ? $0 " (on " n " ranks)" : $0)}' \
             | paste -sd';' -)
    summary+=("$(printf '%-26s %-20s %4ds  %s' "$name" "$verdict" $((SECONDS - start)) "$counts")")
}

# --- GPU, MPI, CUDA-awareness ------------------------------------------------------------------
gpu_name=$(timeout -k 5 60 "$python" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
names = [cupy.cuda.runtime.getDeviceProperties(i)["name"] for i in range(n)]
names = [x.decode() if isinstance(x, bytes) else x for x in names]
print(f"{n} x {names[0]}" if len(set(names)) == 1 else ", ".join(names))' 2>&1 | tail -1)
mpi_library=$(timeout -k 5 60 "$python" -c \
    'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())' 2>&1 | tail -1)
timeout -k 10 $((test_limit + 20)) "$python" -m hpcgrad.info --probe --probe-timeout 60 \
    >"$logs/probe.log" 2>&1
probe_rc=$?
cat "$logs/probe.log"
aware=$(grep -m1 '^CUDA-aware:' "$logs/probe.log" || echo "CUDA-aware: unknown (hpcgrad-info --probe status $probe_rc)")
static=$(grep -m1 'static decision:' "$logs/probe.log" | sed -E 's/^ +//')

# --- GPU tests at 1 rank and at 2 ranks sharing the GPU, then the benchmark ---------------------
run "gpu tests, 1 rank" timeout -k 10 "$test_limit" "$python" -m pytest --with-mpi -m gpu \
    --color=no -q tests
# At 2 ranks only the mpi-marked ones: a serial test run on every rank tests nothing more.
run "gpu tests, 2 ranks" env MPIEXEC_TIMEOUT="$test_limit" timeout -k 10 $((test_limit + 30)) \
    "$mpiexec" "${mpiexec_args[@]}" -n 2 "$python" -m pytest --with-mpi -m "gpu and mpi" \
    --color=no -q tests
run "benchmark, 1 rank" timeout -k 10 "$bench_limit" "$python" benchmarks/gpu.py
run "benchmark, 2 ranks" env MPIEXEC_TIMEOUT="$bench_limit" timeout -k 10 $((bench_limit + 30)) \
    "$mpiexec" "${mpiexec_args[@]}" -n 2 "$python" benchmarks/gpu.py

echo
echo "=== report (tests/gpu.sh, ${SECONDS}s)"
echo "  GPU:        $gpu_name"
echo "  MPI:        $mpi_library ($mpiexec)"
echo "  $aware"
[ -z "$static" ] || echo "    $static"
echo "  installed:  $installed"
printf '  %s\n' "${summary[@]}"
for i in 2 3; do  # the benchmark runs' figures
    sed -n -E 's/^(kernel|all-reduce|DDP)/  \1/p' "$logs/run$i.log"
done
if [ "$failures" -ne 0 ]; then echo "tests/gpu.sh: $failures of $runs runs FAILED"; exit 1; fi
echo "tests/gpu.sh: all $runs runs passed"
