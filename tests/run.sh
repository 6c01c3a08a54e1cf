#!/usr/bin/env bash
# Every test: the serial suite, the documentation build, the mpi-marked tests at 1 and 2 ranks,
# at 3 all but RPC and distributed autograd (those at 4), the engine's tests with replayed
# backward plans off, and the elastic tests under Open MPI with ULFM (.venv-ft, which
# tests/ft_env.sh builds beside the serial runs). CI has two cores: the serial suite runs as
# four runs side by side, and the launched example, GPU-script and elastic tests beside the
# plan-off and the multi-rank runs. Extra args go to each pytest (all serial).
#
#   tests/run.sh                      # everything
#   tests/run.sh -k info              # narrow every run
#   tests/run.sh tests/test_mpi.py    # a path replaces testpaths (pytest.ini) in every run
#
# Env: PYTHON, MPIEXEC, HPCGRAD_TEST_TIMEOUT (s per serial run, default 900),
#      HPCGRAD_MPI_TEST_TIMEOUT (s per multi-rank run, default 240).
set -u
cd "$(dirname "$0")/.."

python=${PYTHON:-python}
# Bytecode caches, even where the shell turns them off: every run collects the suite, and every
# launched rank imports hpcgrad, from source without them (collecting took 25 s instead of 13).
unset PYTHONDONTWRITEBYTECODE
serial_limit=${HPCGRAD_TEST_TIMEOUT:-900}
mpi_limit=${HPCGRAD_MPI_TEST_TIMEOUT:-240}  # (each took 45-65 s alone)

# The mpiexec beside the interpreter belongs to the MPI its mpi4py uses; another one fails with PMI errors.
py_bin=$("$python" -c 'import os, sys; print(os.path.dirname(sys.executable))') || {
    echo "tests/run.sh: cannot run '$python'; activate the venv or set PYTHON" >&2; exit 2; }
if [ -n "${MPIEXEC:-}" ]; then mpiexec=$MPIEXEC
elif [ -x "$py_bin/mpiexec" ]; then mpiexec=$py_bin/mpiexec
else mpiexec=$(command -v mpiexec) || {
    echo "tests/run.sh: no mpiexec beside $python or on PATH; pip install -e '.[mpich,test]'" \
         "or load your site MPI (see docs/cluster.rst)" >&2; exit 2; }
fi

mpiexec_args=()
if "$mpiexec" --version 2>&1 | grep -qiE 'open mpi|open-mpi|openrte|prte'; then
    # Open MPI refuses root and more ranks than cores unless told; its own timeout replaces MPIEXEC_TIMEOUT.
    mpiexec_args=(--oversubscribe --timeout "$mpi_limit")
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# MPICH's ranks poll without pause while they wait (a rank in a barrier held a core for the
# whole 3 s its peer slept), and here four runs share two cores: the launched jobs' waiting
# ranks took the cores the single-process runs needed (those took 130-150 s alone, ~500 s
# beside them). Throttled, a rank that makes no progress sleeps (0.3 s of CPU in those 3 s);
# MPICH's own CI sets the same for its oversubscribed runs. Where a variable is set, it is kept.
export MPIR_CVAR_CH4_PROGRESS_THROTTLE=${MPIR_CVAR_CH4_PROGRESS_THROTTLE:-true}
export MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=${MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT:-1}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
failures=0
runs=0

# run NAME CMD...: run CMD with output teed to a log, then record one summary line.
run() {
    local name=$1; shift
    local log="$logs/run$runs.log" start=$SECONDS
    runs=$((runs + 1))
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$log"
    record "$name" "$log" "${PIPESTATUS[0]}" "$start"
}

# start_beside NAME CMD...: run CMD in the background, its output kept in a log (printed when
# it is collected); collect_beside waits for every run started so and records their lines. CI
# has two cores: runs of launched jobs (much of their time waiting on their ranks' start-up, or
# on purpose for faults and timeouts) beside one single-process run.
beside_names=(); beside_logs=(); beside_pids=(); beside_starts=()
start_beside() {
    local name=$1 log="$logs/run$runs.log"; shift
    runs=$((runs + 1))
    echo "=== $name (beside the next runs): $*"
    ( "$@" > "$log" 2>&1; echo $? > "$log.rc" ) &
    beside_names+=("$name"); beside_logs+=("$log"); beside_pids+=($!); beside_starts+=("$SECONDS")
}

collect_beside() {
    local i
    for i in "${!beside_pids[@]}"; do
        wait "${beside_pids[$i]}"
        echo "=== ${beside_names[$i]}: its output"
        cat "${beside_logs[$i]}"
        record "${beside_names[$i]}" "${beside_logs[$i]}" "$(cat "${beside_logs[$i]}.rc")" \
            "${beside_starts[$i]}"
    done
    beside_names=(); beside_logs=(); beside_pids=(); beside_starts=()
}

# record NAME LOG STATUS START: one summary line for a finished run.
record() {
    local name=$1 log=$2 rc=$3 start=$4 note verdict
    note=""
    if [ "$rc" -eq 5 ]; then rc=0; note=" (no tests collected)"; fi
    # mpiexec reports the largest rank status, and MPICH may exit 0 after MPIEXEC_TIMEOUT kills a
    # hung job, so the log decides too: any rank's "N failed"/"N errors" or a timeout banner fails the run.
    if grep -q 'APPLICATION TIMED OUT' "$log"; then rc=124; fi
    if [ "$rc" -eq 0 ] && grep -qE '\b[0-9]+ (failed|errors?)\b.* in [0-9.]+s' "$log"; then rc=1; fi
    case $rc in
        0) verdict="passed$note" ;;
        124|137) verdict="FAILED (timed out, status $rc)" ;;
        *) verdict="FAILED (status $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || failures=$((failures + 1))
    summary+=("$(printf '%-22s %-32s %4ds' "$name" "$verdict" $((SECONDS - start)))")
    # How many tests compared with PyTorch itself (conftest.py prints it; rank 0's line is enough).
    reference=$(grep -m1 -o 'PyTorch reference tests.*' "$log")
    [ -z "$reference" ] || summary+=("    $reference")
}

# The launched example, GPU-script and elastic tests run beside the plan-off and 1-rank runs
# (below); the elastic ones start their jobs with .venv-ft's fault-tolerant MPI (Open MPI with
# ULFM, a venv of its own: tests/ft_env.sh), which is built beside the serial runs.
# (tests/elastic's one-process tests of State, the multi-rank ones among them, need no
# .venv-ft: they run with the in-process tests, and so at 1, 2 and 3 ranks.)
elastic_ft=()
for test in tests/elastic/test_*.py; do
    case $test in */test_state.py|*/test_state_zero.py) ;; *) elastic_ft+=("$test") ;; esac
done
beside=(tests/examples tests/test_gpu_sh.py tests/test_gpu_benchmark.py "${elastic_ft[@]}")
# The serial suite in four runs side by side: two halves of the tests that run in this process,
# and two of the tests that launch jobs under mpiexec (their ranks' start-up, and waits on
# purpose for faults and timeouts, left a core idle half the time: 341 s of CPU in 332 s).
launched_jobs=(tests/jobs)
launched_rest=(tests/comm tests/collectives tests/rpc tests/dist_autograd tests/remote
               tests/dist_optim tests/cluster tests/slurm)
launched=("${launched_jobs[@]}" "${launched_rest[@]}")
# The tests that run in this process are CPU-bound, one core each: two runs, about even.
in_process_a=(tests/autograd tests/conformance)
# A run beside another has one core: its launched ranks take one thread each. A 1-rank job
# otherwise runs BLAS and numba on both cores (Note [Threads per rank]), whose threads spin
# while the other run holds one: train_resnet.py --arch resnet18 at 1 rank, beside a busy
# core, took 20 s with two threads and 4-6 s with one (38 s of the launched run in CI).
one_core=(env HPCGRAD_THREADS_PER_RANK=1)
if [ $# -eq 0 ]; then
    start_beside "ft venv (.venv-ft)" bash tests/ft_env.sh
    # Each serial run writes down the files that hold mpi-marked tests (conftest.py).
    start_beside "serial, in process A" env HPCGRAD_TEST_MPI_FILES="$logs/in-process-a.mpi-files" \
        timeout -k 10 "$serial_limit" "$python" -m pytest -q "${in_process_a[@]}"
    start_beside "serial, in process B" env HPCGRAD_TEST_MPI_FILES="$logs/in-process-b.mpi-files" \
        timeout -k 10 "$serial_limit" "$python" -m pytest -q \
        "${beside[@]/#/--ignore=}" "${launched[@]/#/--ignore=}" "${in_process_a[@]/#/--ignore=}"
    start_beside "serial, launched jobs" "${one_core[@]}" \
        HPCGRAD_TEST_MPI_FILES="$logs/launched-jobs.mpi-files" \
        timeout -k 10 "$serial_limit" "$python" -m pytest -q "${launched_jobs[@]}"
    run "serial, launched" "${one_core[@]}" HPCGRAD_TEST_MPI_FILES="$logs/launched.mpi-files" \
        timeout -k 10 "$serial_limit" "$python" -m pytest "${launched_rest[@]}"
    collect_beside
else
    run "serial" timeout -k 10 "$serial_limit" "$python" -m pytest "$@"
fi
# The documentation (docs/, Sphinx), warnings as errors: a docstring or page that no longer
# builds fails the suite.
if [ $# -eq 0 ]; then
    run "docs (sphinx -W)" "$python" -m sphinx -W -q -b html docs "$logs/docs-html"
fi
# backward() runs from replayed plans by default (Note [Replayed backward plans]); the engine's
# tests, and the 1-rank run, also run on the queue engine alone.
if [ $# -eq 0 ]; then
    start_beside "examples, GPU, elastic" "${one_core[@]}" timeout -k 10 "$serial_limit" \
        "$python" -m pytest -q "${beside[@]}"
    # (the fuzzer runs every mode itself, and type promotion does not depend on the engine)
    run "serial, plan off" env HPCGRAD_BACKWARD_PLAN=off timeout -k 10 "$serial_limit" \
        "$python" -m pytest -q tests/autograd tests/conformance tests/utils \
        --ignore=tests/autograd/test_fuzz.py --ignore=tests/autograd/test_promotion_issue25.py
fi
# The multi-rank runs collect only the files that the serial runs found mpi-marked tests in
# (every rank collects: the whole suite cost 13-25 s of CPU per rank); if those lists are
# missing (a serial run that failed to collect), they collect everything.
mpi_paths=("$@")
rpc_paths=("$@")
odd_paths=("$@")
if [ $# -eq 0 ]; then
    mapfile -t mpi_paths < <(cat "$logs"/*.mpi-files 2>/dev/null | sort -u)
    mapfile -t rpc_paths < <(cat "$logs"/*.mpi-files.four_ranks 2>/dev/null | sort -u)
    [ ${#rpc_paths[@]} -ne 0 ] || rpc_paths=("${mpi_paths[@]}")
    mapfile -t odd_paths < <(printf '%s\n' "${mpi_paths[@]}" \
                             | grep -vxF -f <(printf '%s\n' "${rpc_paths[@]}"))
fi
# (beside the examples, as the multi-rank runs below: their waiting ranks sleep, MPICH
# throttled above; the examples' run, mostly launched jobs' start-up and waits, took 274 s
# alone and these 180 s after it)
run "mpi, 1 rank, plan off" "${one_core[@]}" HPCGRAD_BACKWARD_PLAN=off timeout -k 10 \
    "$mpi_limit" "$python" -m pytest --with-mpi -m mpi "${mpi_paths[@]}"
run "mpi, 2 ranks" env MPIEXEC_TIMEOUT="$mpi_limit" timeout -k 10 $((mpi_limit + 30)) \
    "$mpiexec" "${mpiexec_args[@]}" -n 2 "$python" -m pytest --with-mpi -m mpi \
    --color=no -q "${mpi_paths[@]}"
# At 3 ranks (an odd world: uneven splits, buckets, trees) all but RPC and distributed autograd,
# which run at 2 and at 4 ranks: their messages are point to point (this saved ~35 s).
run "mpi, 3 ranks" env MPIEXEC_TIMEOUT="$mpi_limit" timeout -k 10 $((mpi_limit + 30)) \
    "$mpiexec" "${mpiexec_args[@]}" -n 3 "$python" -m pytest --with-mpi \
    -m "mpi and not four_ranks" --color=no -q "${odd_paths[@]}"
# RPC and distributed autograd also at 4 ranks (PyTorch's tests use a world of 4).
run "mpi, 4 ranks (rpc)" env MPIEXEC_TIMEOUT="$mpi_limit" timeout -k 10 $((mpi_limit + 30)) \
    "$mpiexec" "${mpiexec_args[@]}" -n 4 "$python" -m pytest --with-mpi -m "mpi and four_ranks" \
    --color=no -q "${rpc_paths[@]}"
[ $# -ne 0 ] || collect_beside

echo "=== summary (tests/run.sh, ${SECONDS}s)"
printf '  %s\n' "${summary[@]}"
if [ "$failures" -ne 0 ]; then echo "tests/run.sh: $failures of $runs runs FAILED"; exit 1; fi
echo "tests/run.sh: all $runs runs passed"
