"""Environment report: versions, MPI, launcher, CUDA-awareness and GPUs, per rank and summarized on rank 0."""

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import hpcgrad
from hpcgrad.base import blas, config
from hpcgrad import coverage
from hpcgrad.comm import hierarchical, ulfm
from hpcgrad.comm.mpi import (CUDA_AWARE_ENV, MPI, _intel_offload, _loaded_mpi_libraries,  # noqa: F401  (the CUDA-aware decision's parts: tests use them)
                              comm_world, cuda_aware_decision, cuda_aware_mpi, mpix_query,
                              ompi_info_text, thread_level)

# (label, env var that proves it). Order matters: mpiexec inside a SLURM allocation still sees
# SLURM_* variables, so the MPI launchers' own variables are checked first.
_LAUNCHERS = (
    ("Open MPI mpirun", "OMPI_COMM_WORLD_RANK"),
    ("MPICH hydra mpiexec", "HYDI_CONTROL_FD"),
    ("MPICH hydra mpiexec", "HYDRA_CONTROL_FD"),
    ("SLURM srun", "SLURM_STEP_ID"),
    ("PMI launcher", "PMI_RANK"),
    ("PMIx launcher", "PMIX_RANK"),
)

# Fields that differ between ranks by nature; the summary prints them per rank.
_PER_RANK = ("rank", "host", "pid", "node", "node_rank", "gpu_count")


def detect_launcher(environ=os.environ):
    """Name the program that started this process, from the environment it left behind."""
    for label, var in _LAUNCHERS:
        if var in environ:
            if label == "SLURM srun" and "SLURM_PROCID" not in environ:
                continue
            return label
    if "SLURM_JOB_ID" in environ:
        return f"singleton (inside SLURM job {environ['SLURM_JOB_ID']}, not srun)"
    return "singleton"


def cupy_status():
    """(description, gpu_count) for cupy; never raises, since a broken CUDA install is common."""
    try:
        import cupy
    except ImportError:
        return "not installed", 0
    except Exception as exc:  # a half-installed cupy can fail with anything at import
        return f"import failed: {type(exc).__name__}: {exc}", 0
    try:
        if not cupy.is_available():
            return f"{cupy.__version__} (not usable: no CUDA device or driver)", 0
        count = cupy.cuda.runtime.getDeviceCount()
        return f"{cupy.__version__} (usable)", int(count)
    except Exception as exc:
        return f"{cupy.__version__} (not usable: {type(exc).__name__}: {exc})", 0


def gpu_count():
    """Number of usable CUDA devices seen through cupy; 0 when cupy is missing or unusable."""
    return cupy_status()[1]


PROBE_VALUES = 4096  # floats per rank: above MPI's eager/inline thresholds would test less


def probe_child():
    """Body of `python -m hpcgrad.info --probe-child`: all-reduce device memory straight through
    mpi4py (no hpcgrad staging) and print PROBE OK or PROBE WRONG; a non-CUDA-aware MPI crashes."""
    import cupy
    comm = comm_world()
    rank, size = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    send = cupy.arange(PROBE_VALUES, dtype=cupy.float32) + rank
    recv = cupy.zeros_like(send)
    cupy.cuda.runtime.deviceSynchronize()  # MPI reads device memory the kernels wrote
    comm.Allreduce(send, recv, op=MPI.SUM)
    want = size * cupy.arange(PROBE_VALUES, dtype=cupy.float32) + size * (size - 1) / 2
    ok = bool(cupy.array_equal(recv, want))
    ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("PROBE OK" if ok else f"PROBE WRONG: got {recv[:4].get()} ..., expected {want[:4].get()} ...",
              flush=True)
    return 0 if ok else 1


# Variables a launcher leaves in its ranks; a nested mpiexec that saw them would join this job.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "OMPI_COMM_WORLD", "OMPI_MCA_orte", "OMPI_MCA_ess",
                    "PRTE_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_STEP", "SLURM_PROCID")


def probe_command(nprocs=2, timeout=60):
    """(argv, env) of the probe job: `mpiexec -n nprocs` beside this Python, else a singleton."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    child = [sys.executable, "-m", "hpcgrad.info", "--probe-child"]
    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec")
    if mpiexec is None or nprocs <= 1:
        return child, env
    args = []
    seconds = str(max(1, math.ceil(timeout)))  # whole seconds: Open MPI's --timeout refuses "60.0"
    try:
        version = subprocess.run([mpiexec, "--version"], check=False, capture_output=True, text=True,
                                 timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if any(word in version.lower() for word in ("open mpi", "open-mpi", "openrte", "prte")):
        args = ["--oversubscribe", "--timeout", seconds]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["MPIEXEC_TIMEOUT"] = seconds
    return [mpiexec, *args, "-n", str(nprocs), *child], env


def probe_cuda_aware(nprocs=2, timeout=60, gpus=None):
    """Confirm CUDA-awareness by running the probe job: (verdict, reason), verdict 'yes', 'no' or
    'unknown'. Never raises and never waits longer than ``timeout`` (+10 s to end the job)."""
    gpus = gpu_count() if gpus is None else gpus
    if gpus == 0:
        return "unknown", "no GPU: cupy is missing or sees no CUDA device"
    argv, env = probe_command(nprocs, timeout)
    try:
        job = subprocess.run(argv, check=False, env=env, capture_output=True, text=True,
                             timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return "no", f"probe timed out after {timeout + 10} s ({' '.join(argv)})"
    except OSError as exc:
        return "unknown", f"probe could not start: {exc}"
    where = f"{nprocs} rank(s)" if argv[0] != sys.executable else "1 rank (no mpiexec)"
    if job.returncode == 0 and "PROBE OK" in job.stdout:
        return "yes", f"probe passed: device all-reduce of {PROBE_VALUES} float32 at {where} correct"
    crash = -job.returncode if job.returncode < 0 else job.returncode - 128
    if job.returncode < 0 or (crash in (signal.SIGSEGV, signal.SIGBUS)
                              and ("signal" in job.stderr or "Segmentation" in job.stderr)):
        # mpiexec reports a rank's signal as 128 + its number (Open MPI 4.1 on an H100 machine:
        # 139): an MPI that is not CUDA-aware reads a device pointer as host memory
        how = f"crashed with {signal.Signals(crash).name}"
        if crash in (signal.SIGSEGV, signal.SIGBUS):
            how += " (as an MPI that is not CUDA-aware does when handed a device pointer)"
    elif "PROBE WRONG" in job.stdout:
        how = "gave wrong values"
    else:
        how = f"exited with status {job.returncode}"
    tail = " | ".join((job.stdout + job.stderr).strip().splitlines()[-3:])[:400]
    return "no", f"probe {how} at {where}: {tail}"


ULFM_PROBE_OK = "ULFM PROBE OK"


def ulfm_probe_child():
    """Body of `python -m hpcgrad.info --ulfm-probe-child` (2 ranks under `mpirun --with-ft
    ulfm`): rank 1 dies without finalizing; rank 0 must see MPI_ERR_PROC_FAILED naming it,
    revoke, and shrink to a world of 1."""
    comm = comm_world().Dup()
    if comm.Get_rank() == 1:
        os._exit(0)
    try:
        comm.Barrier()
        print("ULFM PROBE WRONG: a barrier with a dead rank completed", flush=True)
        return 1
    except MPI.Exception as error:
        if error.Get_error_class() not in ulfm.failure_classes():
            print(f"ULFM PROBE WRONG: {error}", flush=True)
            return 1
    lost = ulfm.failed_ranks(comm)
    ulfm.revoke([comm])
    size = ulfm.shrink(comm, 20).Get_size()
    ok = lost == [1] and size == 1
    print(ULFM_PROBE_OK if ok else f"ULFM PROBE WRONG: lost {lost}, shrunk to {size} ranks",
          flush=True)
    return 0


def ulfm_launch_args():
    """mpirun's arguments for a fault-tolerant job on the Open MPI wheel (Note [Process
    failures under ULFM]): ULFM on, the TCP transport it supports, root and oversubscription
    allowed (the environment variables for root come from ``probe_command``)."""
    return ["--oversubscribe", "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "pml",
            "ob1"]


def probe_fault_tolerance(timeout=60, static=None):
    """(bool, reason): ULFM statically available (``ulfm.available``) and proven by a 2-rank
    job in which one rank dies and the other shrinks the world (``ulfm_probe_child``). Never
    raises and never waits longer than ``timeout`` (+10 s to end the job)."""
    ok, reason = ulfm.available() if static is None else static
    if not ok:
        return False, reason
    argv, env = probe_command(2, timeout)
    if argv[0] == sys.executable:
        return False, f"{reason}, but no mpirun beside this Python to prove it"
    at = argv.index("-n")
    argv = [argv[0], *ulfm_launch_args(), *argv[at:-1], "--ulfm-probe-child"]
    try:
        job = subprocess.run(argv, check=False, env=env, capture_output=True, text=True,
                             timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return False, f"{reason}, but the probe job timed out after {timeout + 10} s"
    except OSError as exc:
        return False, f"{reason}, but the probe job could not start: {exc}"
    # mpirun's status is the dead rank's; the survivor's line is the verdict.
    if ULFM_PROBE_OK in job.stdout:
        return True, (f"{reason}; probe passed: a rank died, the survivor saw "
                      f"MPI_ERR_PROC_FAILED naming it and shrank the world; launch with "
                      f"{ulfm.LAUNCH_LINE}")
    tail = " | ".join((job.stdout + job.stderr).strip().splitlines()[-3:])[:400]
    return False, f"{reason}, but the probe job failed (status {job.returncode}): {tail}"


def format_fault_tolerance(result):
    ok, reason = result
    return f"fault tolerance: ULFM {'available' if ok else 'not available'} ({reason})"


def format_probe(static, probe):
    """One line: 'CUDA-aware: yes (probe passed ...)', with the static decision beside it."""
    verdict, reason = probe
    aware, how = static
    agree = "" if verdict == "unknown" or (verdict == "yes") == aware else "; disagrees with static decision"
    return (f"CUDA-aware: {verdict} ({reason})\n"
            f"  static decision: {'yes' if aware else 'no'} ({how}){agree}")


def numba_threading():
    """(version, threading layer, threads) for numba, loading the layer cheaply."""
    try:
        import numba
    except ImportError:
        return "not installed", "n/a", 0
    try:
        # Starting the thread pool picks the layer in milliseconds; compiling a parallel
        # njit function would do the same but costs about a second per rank.
        from numba.np.ufunc import parallel
        parallel._launch_threads()
        layer = numba.threading_layer()
    except Exception as exc:
        layer = f"unknown (requested {numba.config.THREADING_LAYER!r}; {type(exc).__name__}: {exc})"
    return numba.__version__, layer, numba.config.NUMBA_NUM_THREADS


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def blas_in_use():
    """Which library does the matrix products (Note [MKL for the products]) and the setting
    that chose it."""
    setting = f"HPCGRAD_BLAS={blas._CHOICE}"
    if blas.MKL:
        return f"MKL ({blas._find_mkl()}; {setting})"
    if blas._CHOICE == "auto":
        setting += (": the mkl extra is not installed" if blas._find_mkl() is None else
                    ": not an Intel CPU" if not blas._intel_cpu() else ": MKL did not load")
    return f"numpy's ({setting})"


def collect_info(comm=None):
    """This rank's report as a flat dict. Collective: every rank of comm must call it (shared-memory split)."""
    comm = comm or comm_world()
    # The nodes the hierarchical all-reduce sees (Note [Hierarchical all-reduce]).
    fake = hierarchical.fake_nodes()
    node, nodes, node_rank, ranks_per_node = hierarchical.layout(comm, fake)
    aware, aware_reason = cuda_aware_mpi()
    cupy_desc, gpus = cupy_status()
    numba_version, layer, numba_threads = numba_threading()
    return {
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launcher": detect_launcher(),
        "python": sys.version.split()[0],
        "hpcgrad": hpcgrad.__version__,
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "numba": numba_version,
        "cupy": cupy_desc,
        "gpu_count": gpus,
        "mpi_library": MPI.Get_library_version().strip("\0 \n\t"),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": thread_level(),
        "nodes": nodes,
        "nodes_from": ("shared memory (MPI_COMM_TYPE_SHARED)" if fake is None else
                       f"{hierarchical.FAKE_NODES_ENV}={fake} (rank r on node r * {fake} // size)"),
        "node": node,
        "ranks_per_node": ranks_per_node,
        "node_rank": node_rank,
        "hierarchical_allreduce": _hierarchical_rule(),
        "cuda_aware_mpi": aware,
        "cuda_aware_reason": aware_reason,
        "numba_threading_layer": layer,
        "numba_threads": numba_threads,
        "blas": blas_in_use(),
    }


def _hierarchical_rule():
    """The all-reduce's rule as HPCGRAD_HIERARCHICAL_ALLREDUCE sets it, or its error."""
    try:
        mode = hierarchical.mode_from_env()
        if mode == "auto":
            return (f"auto (across nodes, from {hierarchical.min_bytes_from_env()} bytes, where "
                    f"nodes are not consecutive blocks of ranks; {hierarchical.MIN_BYTES_ENV})")
        return {"0": "off (flat)", "1": "on (every all-reduce)"}[mode]
    except ValueError as error:
        return f"invalid: {error}"


def gather_info(comm=None, root=0):
    """Every rank's report, as a list indexed by rank on root (None elsewhere). Collective."""
    comm = comm or comm_world()
    return comm.gather(collect_info(comm), root=root)


def summarize(reports):
    """Split reports into fields shared by all ranks and a per-rank table of the rest."""
    keys = list(reports[0])
    common = {k: reports[0][k] for k in keys
              if k not in _PER_RANK and all(r.get(k) == reports[0][k] for r in reports)}
    varying = [k for k in keys if k not in common]
    return common, varying


def format_report(reports):
    """Human-readable summary: one line per shared field, then one row per rank."""
    common, varying = summarize(reports)
    lines = [f"hpcgrad environment report: {len(reports)} rank(s)"]
    width = max(map(len, common), default=0)
    for key, value in common.items():
        # The library banner is multi-line; its first line names the library and version.
        text = " ".join(str(value).splitlines()[0].split()) if key == "mpi_library" else str(value)
        lines.append(f"  {key:<{width}}  {text}")
    rows = [varying] + [[str(r.get(k, "")) for k in varying] for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(varying))]
    lines.append("per rank:")
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def print_config(as_json=False):
    """``--config``: every HPCGRAD_* setting (Note [One place for settings] in hpcgrad/base/config.py)."""
    rows = config.table()
    if as_json:
        keys = ("name", "value", "default", "read", "meaning", "audience")
        print(json.dumps([dict(zip(keys, row)) for row in rows], indent=1))
        return 0
    for audience, title in (("user", "settings"),
                            ("simulation", "the simulated cluster (one machine as N nodes)"),
                            ("internal", "set by hpcgrad for processes it starts")):
        print(f"HPCGRAD_* {title}:")
        for name, value, default, read, meaning, who in rows:
            if who == audience:
                print(f"  {name} = {value}  [default {default}; read {read}]\n      {meaning}")
    sys.stdout.flush()
    return 0


def main(argv=None):
    """Entry point of `python -m hpcgrad.info` and `hpcgrad-info`."""
    parser = argparse.ArgumentParser(prog="hpcgrad-info", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the gathered reports as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="confirm CUDA-awareness with a device all-reduce in a bounded job "
                             "(mpiexec -n 2 beside this Python); Note [CUDA-aware decision]; and "
                             "fault tolerance (ULFM) with a 2-rank job in which one rank dies")
    parser.add_argument("--probe-timeout", type=float, default=60, help="seconds for the probe job")
    parser.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ulfm-probe-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coverage", nargs="+", metavar="FILE",
                        help="list the torch.* names these scripts use that hpcgrad lacks, with their "
                             "lines (parsed, not run); status 1 when some are missing, 2 when a file "
                             "cannot be read or parsed; with --json, as JSON")
    parser.add_argument("--config", action="store_true",
                        help="list every HPCGRAD_* setting: this process's value, the default, "
                             "when it is read and what it does (no MPI job is gathered)")
    args = parser.parse_args(argv)
    if args.config:
        return print_config(as_json=args.json)
    if args.coverage:
        if args.probe or args.probe_child:
            parser.error("--coverage reads scripts and starts no job: leave out --probe")
        return coverage.main(args.coverage, as_json=args.json)
    if args.probe_child:
        return probe_child()
    if args.ulfm_probe_child:
        return ulfm_probe_child()
    reports = gather_info()
    if reports is None:
        return 0
    if args.probe:  # rank 0 alone starts the probe job
        static = cuda_aware_decision()
        verdict, reason = probe_cuda_aware(timeout=args.probe_timeout)
        fault_tolerance = probe_fault_tolerance(timeout=args.probe_timeout)
        for report in reports:
            report.update(cuda_aware_static=static[0], cuda_aware_static_reason=static[1],
                          cuda_aware_probe=verdict, cuda_aware_probe_reason=reason,
                          fault_tolerance=fault_tolerance[0],
                          fault_tolerance_reason=fault_tolerance[1])
    if args.json:
        common, _ = summarize(reports)
        print(json.dumps({"size": len(reports), "common": common, "ranks": reports}, indent=2))
    else:
        print(format_report(reports))
        if args.probe:
            print(format_probe(static, (verdict, reason)))
            print(format_fault_tolerance(fault_tolerance))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
