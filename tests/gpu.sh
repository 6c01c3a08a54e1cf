#!/usr/bin/env bash
# One command for a GPU machine: install, probe CUDA-aware MPI, GPU tests at 1 and 2 ranks, benchmarks/gpu.py, report.
#
#   bash tests/gpu.sh              # what is missing must already be installed (no index needed)
#   bash tests/gpu.sh WHEEL_DIR    # a machine without network: missing packages from WHEEL_DIR
#
# WHEEL_DIR is made on a machine with an index (Python 3.12, x86_64, as ../shared/ENVIRONMENT.md):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --dest wheels pytest-mpi pytest-timeout mpich \
#       impi-rt==2021.18.1 ml_dtypes setuptools
# Only what the machine lacks is installed from it, each wheel with --no-deps (and
# --ignore-installed: the venv's own copy, whatever the base has): pytest-mpi and
# pytest-timeout if missing; mpich if mpi4py finds no MPI library or no mpiexec is at hand;
# ml_dtypes (bfloat16 tests) if there. With an impi_rt wheel in it, a second pass runs under
# Intel MPI with its CUDA offload (I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda): the probe, the GPU
# tests at 2 ranks and the benchmark at 2 ranks, in a venv of its own, $VENV/impi
# (HPCGRAD_GPU_IMPI=0: skip).
#
# The venv (HPCGRAD_GPU_VENV, default .venv-gpu) is made with --system-site-packages from $PYTHON
# (default python3), so the machine's own cupy, numba-cuda, mpi4py and torch serve (where $PYTHON
# is itself a venv's, a .pth file adds that venv's site-packages too); it is reused
# when it exists. hpcgrad goes in editable (pip -e, no build isolation), or, where pip cannot
# build it (no setuptools >= 64), as a .pth file naming this checkout, which is what an editable
# install amounts to. HPCGRAD_GPU_VENV=none uses $PYTHON as it is, installing nothing.
# Without a GPU it checks that everything imports, prints "no GPU: ..." and exits 0 (CI may call
# it); HPCGRAD_GPU_DRY_RUN=1 runs every step anyway (the GPU tests skip, the benchmark runs its
# --cpu dry run), to check this script where no GPU is.
# Every run is bounded: HPCGRAD_GPU_TEST_TIMEOUT (s per test run, default 300),
# HPCGRAD_GPU_BENCH_TIMEOUT (s per benchmark run, default 300). Exit status 1 if any run failed.
set -u
cd "$(dirname "$0")/.."

wheels=${1:-}
venv=${HPCGRAD_GPU_VENV:-.venv-gpu}
base_python=${PYTHON:-python3}
test_limit=${HPCGRAD_GPU_TEST_TIMEOUT:-300}
bench_limit=${HPCGRAD_GPU_BENCH_TIMEOUT:-300}
dry=${HPCGRAD_GPU_DRY_RUN:-0}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

die() { echo "tests/gpu.sh: $*" >&2; exit 2; }
[ -z "$wheels" ] || [ -d "$wheels" ] || die "wheel folder '$wheels' does not exist"
[ -z "$wheels" ] || wheels=$(cd "$wheels" && pwd)

# wheel NAME: the newest wheel of distribution NAME in the wheel folder (none: empty).
wheel() {
    [ -n "$wheels" ] || return 0
    local pattern=${1//-/_}
    ls -1 "$wheels"/ 2>/dev/null | grep -iE "^${pattern}-[0-9][^-]*-.*\.whl$" | sort -V | tail -1
}

# make_venv DIR: a venv over $base_python's packages (without pip of its own if ensurepip is
# missing: the base's pip, seen through the system site-packages, installs into it just as well).
make_venv() {
    [ -x "$1/bin/python" ] && return 0
    "$base_python" -m venv --system-site-packages "$1" >"$logs/venv.log" 2>&1 \
        || { rm -rf "$1"; "$base_python" -m venv --system-site-packages --without-pip "$1" \
                 >>"$logs/venv.log" 2>&1; } \
        || { cat "$logs/venv.log" >&2; die "cannot make a venv at $1 with $base_python"; }
    # A venv made from a venv's python sees the base interpreter's site-packages, not that venv's
    # (where a GPU image keeps its cupy and torch): a .pth file adds them after the new venv's own.
    "$base_python" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))' \
        >"$logs/parent.pth" || die "cannot read the site-packages of $base_python"
    if [ -s "$logs/parent.pth" ]; then
        cp "$logs/parent.pth" "$("$1/bin/python" -c \
            'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hpcgrad-parent-venv.pth" \
            || die "cannot write the parent venv's .pth file into $1"
    fi
    "$1/bin/python" -m pip --version >/dev/null 2>&1 \
        || die "$1/bin/python has no pip (neither its own nor $base_python's); install python3-pip"
}

# install_hpcgrad PYTHON: editable, else a .pth file; prints how.
install_hpcgrad() {
    local python=$1 site
    if timeout -k 10 300 "$python" -m pip install -q --no-deps --no-build-isolation -e . \
            >"$logs/pip-hpcgrad.log" 2>&1; then
        echo "pip install --no-deps -e ."
        return 0
    fi
    site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
        || die "cannot find the site-packages of $python"
    echo "$PWD" >"$site/hpcgrad-checkout.pth" || die "cannot write $site/hpcgrad-checkout.pth"
    echo "$site/hpcgrad-checkout.pth -> $PWD (pip -e failed: $(grep -m1 -iE 'error|no module' \
        "$logs/pip-hpcgrad.log" | cut -c1-100))"
}

# from_wheels PYTHON NAME...: install each NAME's wheel from the folder, --no-deps; prints what.
from_wheels() {
    local python=$1 name file done=()
    shift
    for name in "$@"; do
        file=$(wheel "$name")
        [ -n "$file" ] || continue
        if timeout -k 10 300 "$python" -m pip install -q --no-index --no-deps --ignore-installed \
                "$wheels/$file" >>"$logs/pip-wheels.log" 2>&1; then
            done+=("$file")
        else
            tail -3 "$logs/pip-wheels.log" >&2
        fi
    done
    echo "${done[*]:-}"
}

# missing PYTHON: the distributions PYTHON lacks among the test tools ("mpi" for an MPI library).
missing() {
    "$1" - <<'EOF'
import importlib.util as u
need = [n for m, n in (("pytest", "pytest"), ("pytest_mpi", "pytest-mpi"),
        ("pytest_timeout", "pytest-timeout"), ("numba", "numba"), ("mpi4py", "mpi4py"))
        if u.find_spec(m) is None]
if "mpi4py" not in need:
    try:
        from mpi4py import MPI  # noqa: F401  (fails without an MPI library)
    except Exception:
        need.append("mpi")
print(" ".join(need))
EOF
}

# mpiexec_for PYTHON: the mpiexec beside PYTHON (its MPI), else $MPIEXEC, else the first on PATH.
mpiexec_for() {
    local bin
    bin=$("$1" -c 'import os, sys; print(os.path.dirname(sys.executable))')
    if [ -x "$bin/mpiexec" ]; then echo "$bin/mpiexec"
    elif [ -n "${MPIEXEC:-}" ]; then echo "$MPIEXEC"
    else command -v mpiexec || true
    fi
}

# --- the interpreter, and hpcgrad and the test tools installed into it --------------------------
installed=()
if [ "$venv" = none ]; then
    python=$base_python
    installed=("none (HPCGRAD_GPU_VENV=none: $python as it is)")
else
    make_venv "$venv"
    python=$venv/bin/python
    installed=("hpcgrad: $(install_hpcgrad "$python")")
    need=$(missing "$python")
    want=()
    for name in $need; do case $name in pytest-mpi|pytest-timeout) want+=("$name") ;; esac; done
    if [[ " $need " == *" mpi "* ]] || [ -z "$(mpiexec_for "$python")" ]; then want+=(mpich); fi
    "$python" -c 'import ml_dtypes' 2>/dev/null || want+=(ml_dtypes)
    if [ ${#want[@]} -gt 0 ]; then
        got=$(from_wheels "$python" "${want[@]}")
        [ -z "$got" ] || installed+=("from $wheels: $got")
    fi
fi
need=$(missing "$python")
need=$(echo " $need " | sed 's/ mpi / an MPI library for mpi4py (the mpich wheel) /; s/^ //; s/ $//')
[ -z "$need" ] || die "$python lacks $need;" \
    "on a machine with an index run the pip download in this script's header, carry the" \
    "folder, and run: bash tests/gpu.sh FOLDER"

# --- everything imports, with or without a GPU --------------------------------------------------
imports="import hpcgrad, hpcgrad.cuda, hpcgrad.distributed, hpcgrad.info, hpcgrad.base.kernels.cuda, hpcgrad.nn.parallel"
timeout -k 5 120 "$python" -c "$imports" || die "importing hpcgrad failed with $python (see above)"
gpus=$(timeout -k 5 120 "$python" -c 'from hpcgrad.info import cupy_status; d, n = cupy_status(); print(n, d)') \
    || die "hpcgrad.info.cupy_status failed with $python"
bench_args=()
if [ "${gpus%% *}" = 0 ]; then
    if [ "$dry" != 1 ]; then
        echo "no GPU: cupy ${gpus#* }; everything imports with $python; nothing else to run"
        exit 0
    fi
    echo "no GPU: cupy ${gpus#* }; HPCGRAD_GPU_DRY_RUN=1: every step anyway (GPU tests skip)"
    read -r -a bench_args <<<"${HPCGRAD_GPU_BENCH_ARGS:---cpu --quick --megabytes 1 --batch 8}"
else
    read -r -a bench_args <<<"${HPCGRAD_GPU_BENCH_ARGS:-}"
fi

# The test modules with GPU cases (the xp fixture of tests/arrays.py, or the gpu mark): a module
# elsewhere that imports an optional package the machine lacks must not fail the GPU run.
mapfile -t gpu_tests < <(grep -rlE --include='test_*.py' 'xp_fixture|mark\.gpu\b' tests | sort)
[ ${#gpu_tests[@]} -gt 0 ] || die "no GPU test modules found under tests/"

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
    if grep -aq 'APPLICATION TIMED OUT' "$log"; then rc=124; fi
    if [ "$rc" -eq 0 ] && grep -aqE '\b[0-9]+ (failed|errors?)\b.* in [0-9.]+s' "$log"; then rc=1; fi
    case $rc in
        0) verdict="passed" ;;
        124|137) verdict="FAILED (timed out)" ;;
        *) verdict="FAILED (status $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || failures=$((failures + 1))
    # pytest's last line per rank ("12 passed, 3 skipped in 4.1s"), ranks that agree counted once;
    # only the counts are taken, since another rank's progress dots may share the line.
    counts=$(grep -aoE '([0-9]+ [a-z]+(, )?)+ in [0-9.]+s|no tests ran in [0-9.]+s' "$log" \
             | sed -E 's/ in [0-9.]+s$//' | sort | uniq -c \
             | awk '{n = $1; sub(/^ *[0-9]+ /, ""); print (n > 1 ? $0 " (on " n " ranks)" : $0)}' \
             | paste -sd';' -)
    summary+=("$(printf '%-34s %-20s %4ds  %s' "$name" "$verdict" $((SECONDS - start)) "$counts")")
    run_names+=("$name")
}

# launcher_args MPIEXEC LIMIT: what Open MPI needs as root and for its own timeout.
launcher_args() {
    if "$1" --version 2>&1 | grep -qiE 'open mpi|open-mpi|openrte|prte'; then
        echo "--oversubscribe --timeout $2"
    fi
}

# probe PYTHON: hpcgrad-info --probe's CUDA-aware verdict (and its static decision), and the
# road device collectives take (Note [Device collectives per MPI]); printed, and kept in
# $aware, $static and $road.
probe() {
    timeout -k 10 200 "$1" -m hpcgrad.info --probe --probe-timeout 60 >"$logs/probe.log" 2>&1
    local rc=$?
    cat "$logs/probe.log"
    aware=$(grep -a -m1 '^CUDA-aware:' "$logs/probe.log" \
            || echo "CUDA-aware: unknown (hpcgrad-info --probe status $rc)")
    static=$(grep -a -m1 'static decision:' "$logs/probe.log" | sed -E 's/^ +//')
    road=$(timeout -k 5 120 "$1" -c '
from mpi4py import MPI
from hpcgrad.comm import buffers, device_path
print("device collectives: %s (%s)" % device_path.decide(MPI.Get_library_version(), buffers.cuda_aware()))' \
           2>&1 | tail -1)
}

run_names=()
gpu_name=$(timeout -k 5 60 "$python" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
names = [cupy.cuda.runtime.getDeviceProperties(i)["name"] for i in range(n)]
names = [x.decode() if isinstance(x, bytes) else x for x in names]
print(f"{n} x {names[0]}" if len(set(names)) == 1 else ", ".join(names))' 2>&1 | tail -1)
[ "${gpus%% *}" != 0 ] || gpu_name="none (dry run: cupy ${gpus#* })"
mpi_library=$(timeout -k 5 60 "$python" -c \
    'from mpi4py import MPI; print(MPI.Get_library_version().strip("\0 \n").splitlines()[0].strip())' 2>&1 | tail -1)
mpiexec=$(mpiexec_for "$python")
[ -n "$mpiexec" ] || die "no mpiexec beside $python or on PATH; pass a wheel folder with mpich"
read -r -a test_launch <<<"$(launcher_args "$mpiexec" "$test_limit")"
read -r -a bench_launch <<<"$(launcher_args "$mpiexec" "$bench_limit")"
if [ ${#test_launch[@]} -gt 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# --- GPU, MPI, CUDA-awareness; GPU tests at 1 rank and at 2 ranks sharing the GPU; benchmark ----
probe "$python"
main_aware=$aware main_static=$static main_road=$road
run "gpu tests, 1 rank" timeout -k 10 "$test_limit" "$python" -m pytest --with-mpi -m gpu \
    --color=no -q "${gpu_tests[@]}"
# At 2 ranks only the mpi-marked ones: a serial test run on every rank tests nothing more.
run "gpu tests, 2 ranks" env MPIEXEC_TIMEOUT="$test_limit" timeout -k 10 $((test_limit + 30)) \
    "$mpiexec" "${test_launch[@]}" -n 2 "$python" -m pytest --with-mpi -m "gpu and mpi" \
    --color=no -q "${gpu_tests[@]}"
run "benchmark, 1 rank" timeout -k 10 "$bench_limit" "$python" benchmarks/gpu.py "${bench_args[@]}"
run "benchmark, 2 ranks" env MPIEXEC_TIMEOUT="$bench_limit" timeout -k 10 $((bench_limit + 30)) \
    "$mpiexec" "${bench_launch[@]}" -n 2 "$python" benchmarks/gpu.py "${bench_args[@]}"

# --- Intel MPI's CUDA offload, when its runtime wheel came along --------------------------------
impi_lines=()
impi=$(wheel impi-rt)
if [ -n "$impi" ] && [ "${HPCGRAD_GPU_IMPI:-1}" != 0 ] && [ "$venv" != none ]; then
    echo "=== Intel MPI pass: $impi in $venv/impi"
    ivenv=$venv/impi  # inside the first venv: ignored by git with it
    make_venv "$ivenv"
    ipython=$ivenv/bin/python
    how=$(install_hpcgrad "$ipython")
    want=(impi-rt)
    for name in $(missing "$ipython"); do
        case $name in pytest-mpi|pytest-timeout) want+=("$name") ;; esac
    done
    "$ipython" -c 'import ml_dtypes' 2>/dev/null || want+=(ml_dtypes)
    from_wheels "$ipython" "${want[@]}" >/dev/null
    ilibrary=$(timeout -k 5 60 "$ipython" -c \
        'from mpi4py import MPI; print(MPI.Get_library_version().strip("\0 \n").splitlines()[0].strip())' 2>&1 | tail -1)
    impiexec=$ivenv/bin/mpiexec
    if [[ "$ilibrary" != *Intel* ]] || [ ! -x "$impiexec" ]; then
        impi_lines+=("Intel MPI: not used: mpi4py in $ivenv loads '$ilibrary' (mpiexec: $impiexec)")
        failures=$((failures + 1))
    else
        # Offload only with a GPU (without one Intel MPI cannot load its CUDA back-end); one node:
        # shared memory, so libfabric's providers need not find a network.
        export I_MPI_FABRICS=${I_MPI_FABRICS:-shm}
        if [ "${gpus%% *}" != 0 ]; then export I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda; fi
        probe "$ipython"
        settings="I_MPI_OFFLOAD=${I_MPI_OFFLOAD:-unset} I_MPI_OFFLOAD_MODE=${I_MPI_OFFLOAD_MODE:-unset}"
        impi_lines+=("Intel MPI: $ilibrary ($impiexec; $settings I_MPI_FABRICS=$I_MPI_FABRICS)")
        impi_lines+=("  $aware" "    $static" "  $road" "  installed: hpcgrad: $how; $impi")
        if [ "${gpus%% *}" != 0 ] && [[ "$aware" != "CUDA-aware: yes"* ]]; then
            # The offload did not pass the probe: what failed is in the line above; the tests
            # and the benchmark then check the fallback, host staging, under Intel MPI.
            export HPCGRAD_CUDA_AWARE_MPI=0
            impi_lines+=("  the probe did not pass: runs below with HPCGRAD_CUDA_AWARE_MPI=0 (staged)")
        fi
        run "gpu tests, 2 ranks, Intel MPI" env MPIEXEC_TIMEOUT="$test_limit" \
            timeout -k 10 $((test_limit + 30)) "$impiexec" -n 2 "$ipython" -m pytest --with-mpi \
            -m "gpu and mpi" --color=no -q "${gpu_tests[@]}"
        run "benchmark, 2 ranks, Intel MPI" env MPIEXEC_TIMEOUT="$bench_limit" \
            timeout -k 10 $((bench_limit + 30)) "$impiexec" -n 2 "$ipython" benchmarks/gpu.py \
            "${bench_args[@]}"
    fi
fi

echo
echo "=== report (tests/gpu.sh, ${SECONDS}s)"
echo "  GPU:        $gpu_name"
echo "  MPI:        $mpi_library ($mpiexec)"
echo "  $main_aware"
[ -z "$main_static" ] || echo "    $main_static"
echo "  $main_road"
printf '  installed:  %s\n' "${installed[@]}"
[ ${#impi_lines[@]} -eq 0 ] || printf '  %s\n' "${impi_lines[@]}"
printf '  %s\n' "${summary[@]}"
for ((i = 0; i < runs; i++)); do  # the benchmark runs' figures, under their run's name
    if grep -aqE '^(kernel|all-reduce|DDP)' "$logs/run$i.log"; then
        echo "  -- ${run_names[$i]}"
        sed -n -E 's/^(kernel|all-reduce|DDP)/    \1/p' "$logs/run$i.log"
    fi
done
if [ "$failures" -ne 0 ]; then echo "tests/gpu.sh: $failures of $runs runs FAILED"; exit 1; fi
echo "tests/gpu.sh: all $runs runs passed"
