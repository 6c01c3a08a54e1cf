"""Every HPCGRAD_* environment variable: its name, default, when it is read and what it does.

Note [One place for settings]
    The package reads an HPCGRAD_* variable only through ``raw`` here, and ``raw`` knows only
    the names in SETTINGS: a reader cannot exist without its line in this table, so the table
    (``python -m hpcgrad.info --config`` prints it with this process's values) is the complete
    list. Each module keeps the meaning of its own values (parsing, and the error that says
    what was expected), next to the code that uses them; ``whole_number`` and ``flag`` are the
    shared wordings for whole-number and 0/1 settings. tests/base/test_config.py scans the package
    for names this table lacks and for reads that bypass it.

    Audience: "user" settings are documented for users; "simulation" ones drive the simulated
    cluster on one machine (hpcgrad/comm/hierarchical.py, benchmarks, tests); "internal" ones
    are set by hpcgrad for processes it starts itself, never by a user.
"""

import os
from typing import NamedTuple


class Setting(NamedTuple):
    name: str
    default: str  # as a user would write it; "" when unset is the default
    read: str  # when the package reads it
    meaning: str
    audience: str = "user"


SETTINGS = (
    Setting("HPCGRAD_COMM_TIMEOUT", "1800",
            "at init_process_group, new_group and init_rpc (their default timeout)",
            "seconds any communication wait may take before CommTimeoutError (or the job "
            "ends); 0: no bound"),
    Setting("HPCGRAD_STALL_WARNING", "60",
            "at init_process_group and init_rpc (all ranks agree on the smallest)",
            "seconds a collective or a start-up may wait before rank 0 reports who is "
            "missing; 0: the stall inspector is off"),
    Setting("HPCGRAD_DISTRIBUTED_DEBUG", "INFO",
            "when a process group is created",
            "OFF, INFO (collectives' element sizes compared across ranks) or DETAIL (every "
            "call's op, shape and dtype compared)"),
    Setting("HPCGRAD_FLIGHT_RECORDER", "2000", "at import of hpcgrad",
            "entries in each rank's ring of recent communication calls; 0: dumps hold none"),
    Setting("HPCGRAD_FLIGHT_DIR", "./hpcgrad-flight", "at import of hpcgrad",
            "where ranks write flight_rank<R>.json on a timeout, stall, abort or SIGUSR2"),
    Setting("HPCGRAD_TIMELINE", "", "at import of hpcgrad",
            "PATH: each rank records spans to PATH.rank<R>; the jobs merge them into PATH"),
    Setting("HPCGRAD_BACKWARD_PLAN", "on", "at the first backward",
            "on (replayed backward plans), off (the queue engine) or reference (the "
            "reference order, for tests)"),
    Setting("HPCGRAD_PROGRESS_THREAD", "auto",
            "at init_process_group and when DistributedDataParallel is built",
            "1: a thread drives MPI progress from the start; 0: never; auto: DDP starts it "
            "when its group spans nodes"),
    Setting("HPCGRAD_THREADS_PER_RANK", "", "at init_process_group",
            "threads for numba/BLAS/OpenMP per rank; unset: the node's cores shared between "
            "its ranks (unless OMP_NUM_THREADS and friends are set)"),
    Setting("HPCGRAD_HIERARCHICAL_ALLREDUCE", "0", "when a process group is created",
            "0 (flat all-reduce), 1 (always within nodes, then across) or auto (across "
            "nodes, from HPCGRAD_HIERARCHICAL_MIN_BYTES)"),
    Setting("HPCGRAD_HIERARCHICAL_MIN_BYTES", "4194304", "when a process group is created",
            "the smallest message the auto hierarchical all-reduce takes"),
    Setting("HPCGRAD_CUDA_AWARE_MPI", "",
            "once, when a process group is built on a machine with a GPU or MPI first meets a "
            "GPU array",
            "1 or 0: whether MPI reads device memory, overriding the detection"),
    Setting("HPCGRAD_DEVICE_COLLECTIVES", "", "when a process group is created",
            "direct, thread or staged: the path of collectives on GPU arrays; unset: decided "
            "from the MPI library"),
    Setting("HPCGRAD_CUDA_NORMS", "0", "at each BatchNorm, LayerNorm or softmax on a GPU array",
            "1: they run as numba CUDA kernels (kernels/cuda_norms.py; tested under numba's "
            "simulator, not yet on a GPU); 0: as cupy array expressions"),
    Setting("HPCGRAD_CUDA_POINTWISE", "0", "at each GELU or Adam step on a GPU array",
            "1: they run as numba CUDA kernels (kernels/cuda_pointwise.py; tested under numba's "
            "simulator, not yet on a GPU); 0: as cupy array expressions"),
    Setting("HPCGRAD_CUDA_COLUMNS", "0", "at each convolution through columns on a GPU array",
            "1: its columns are unfolded and folded back by numba CUDA kernels "
            "(kernels/cuda_columns.py; tested under numba's simulator, not yet on a GPU); 0: "
            "as cupy array expressions"),
    Setting("HPCGRAD_DIRECT_CONV", "1", "at each convolution on numpy arrays",
            "1: convolutions of few channels (forward; at stride 1 also both gradients) run as "
            "direct kernels (kernels/direct_conv.py); 0: always through columns and a matrix "
            "product"),
    Setting("HPCGRAD_CAUSAL_BLOCKS", "1", "at each causal scaled_dot_product_attention",
            "1: causal attention on numpy float32/float64 with MKL, from 64 queries, runs its "
            "products a block of 32 queries at a time, skipping the masked keys "
            "(nn/_causal_attention.py); 0: the full products and the masked softmax"),
    Setting("HPCGRAD_WINOGRAD", "1", "at each convolution on numpy arrays",
            "1: 3x3 convolutions at stride 1 with at least 48 input and output channels "
            "(forward and both gradients) run through Winograd's F(2x2, 3x3) tiles "
            "(kernels/winograd.py); 0: through columns or direct kernels"),
    Setting("HPCGRAD_BLAS", "auto", "at the first matrix product (import of hpcgrad.base.blas)",
            "auto: the hot matrix products through MKL's cblas (one thread a rank) where the "
            "mkl extra is installed and the CPU is Intel's, else numpy's BLAS (OpenBLAS in its "
            "wheels); mkl: MKL on any CPU (an error if absent); numpy: never MKL "
            "(docs/performance.rst)"),
    Setting("HPCGRAD_KEEP_FREED_MEMORY", "1", "at import of hpcgrad",
            "1: glibc's malloc keeps freed blocks (below 32 MB, up to 1 GB) for the next step "
            "instead of returning them to the kernel, process-wide (hpcgrad/base/memory.py); 0: "
            "glibc's defaults. Ignored where MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ "
            "is set"),
    Setting("HPCGRAD_NO_ABORT_HOOK", "0", "at import of hpcgrad",
            "1: an uncaught exception ends only its own rank (interactive use); 0: the whole "
            "job"),
    Setting("HPCGRAD_ELASTIC_TIMEOUT", "60", "at each recovery of hpcgrad.distributed.elastic",
            "seconds a survivor waits for the others to join a recovery (agree, shrink, "
            "rebuild) after a rank is lost; past it the job ends"),
    Setting("HPCGRAD_FAKE_NODES", "", "when a process group is created",
            "N: the ranks on this machine act as N nodes (the simulated cluster)",
            "simulation"),
    Setting("HPCGRAD_FAKE_PLACEMENT", "block", "when a process group is created",
            "block or cyclic: how simulated nodes hold ranks", "simulation"),
    Setting("HPCGRAD_TORCHRUN_ENV_PID", "", "set and read at init_process_group",
            "the process that set RANK, WORLD_SIZE, ...: a child started by it sets them "
            "afresh", "internal"),
    Setting("HPCGRAD_SPAWNED", "", "at hpcgrad.multiprocessing.spawn",
            "set in the ranks spawn() starts: they run the function, not spawn again",
            "internal"),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}


def raw(name, environ=None):
    """The variable ``name`` as set ("" when unset), from ``environ`` (default os.environ). A
    name not in SETTINGS is a KeyError: document a setting before reading it."""
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a setting hpcgrad knows: add it to SETTINGS in "
                       f"hpcgrad/base/config.py (Note [One place for settings])")
    return (os.environ if environ is None else environ).get(name, "")


def whole_number(name, minimum, meaning, default=None, environ=None):
    """``name`` as an int >= ``minimum``; ``default`` when unset or empty. Anything else is a
    ValueError: '<name> must be <meaning>, got <the value>'."""
    text = raw(name, environ).strip()
    if text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be {meaning}, got {text!r}")
    return value


def flag(name, default, meaning, environ=None):
    """``name`` as 0/1 (``default`` when unset); anything else is a ValueError saying
    ``meaning``."""
    value = raw(name, environ).strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be '0' or '1', got {value!r}; "
                         f"{meaning}")
    return value == "1"


def table(environ=None):
    """One row per setting: (name, value as set or '(default)', default, read, meaning,
    audience), in SETTINGS' order."""
    environ = os.environ if environ is None else environ
    return [(s.name, environ[s.name] if s.name in environ else "(default)", s.default or "unset",
             s.read, s.meaning, s.audience) for s in SETTINGS]
