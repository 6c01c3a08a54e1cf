"""Test harness: the MPI abort hook, bounded multi-rank tests, GPU skipping and the `launch` fixture (tests/launching.py)."""

import os
import tempfile

import pytest

# Flight records that failing tests write (Note [Flight recorder]) go to a scratch directory,
# not into the checkout; set before hpcgrad reads it. Launched jobs inherit it.
os.environ.setdefault("HPCGRAD_FLIGHT_DIR", os.path.join(tempfile.gettempdir(), "hpcgrad-flight-tests"))

from launching import run_job  # noqa: E402  (tests/launching.py)

import hpcgrad.distributed as dist  # noqa: E402
from hpcgrad.comm.mpi import comm_world  # noqa: E402  (under mpiexec, importing installs the abort-on-exception hook)


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads the method
def pytest_configure(config):
    if comm_world().Get_size() > 1 and config.getoption("timeout_method", None) is None:
        config.option.timeout_method = "thread"


# A test that fails on one rank leaves its peers in a collective: they get a CommTimeoutError
# after this long (and report it) instead of hanging until the run's MPIEXEC_TIMEOUT.
GROUP_TIMEOUT = 30


@pytest.fixture
def world():
    """The default process group (init_process_group is idempotent: the first call creates it)."""
    return dist.init_process_group(timeout=GROUP_TIMEOUT)


@pytest.fixture
def group():
    """A fresh communicator per test, with a timeout: a hang fails the test, and whatever a
    failed test left pending stays out of the next one."""
    dist.init_process_group(timeout=GROUP_TIMEOUT)
    g = dist.new_group(timeout=2 * GROUP_TIMEOUT)  # DDP steps at 3 ranks on 2 cores are slow
    yield g
    dist.destroy_process_group(g)


_FOUR_RANK_MODULES = ("test_rpc", "test_dist_autograd")


def _uses_torch(code, depth=0):
    """True when a test's code names torch (a global, ``importorskip("torch")``, ``torch_or_skip``)."""
    names = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
    if names & {"torch", "torch_or_skip"}:
        return True
    return depth < 2 and any(_uses_torch(c, depth + 1) for c in code.co_consts
                             if hasattr(c, "co_names"))


def pytest_collection_modifyitems(config, items):
    # Count the tests that compare with PyTorch itself, so the summary can say how many ran.
    for item in items:
        code = getattr(getattr(item, "obj", None), "__code__", None)
        if code is not None and (_uses_torch(code)
                                 or getattr(getattr(item, "module", None), "torch", None) is not None):
            item.add_marker("torch_reference")
    # RPC and distributed autograd also run at 4 ranks (PyTorch's tests use world size 4).
    for item in items:
        if item.path.name.startswith(_FOUR_RANK_MODULES):
            item.add_marker("four_ranks")
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # importing cupy only to skip nothing would cost seconds
    from hpcgrad.info import gpu_count
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU: cupy is missing or cupy.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """tests/run.sh: the serial runs write down which files hold mpi-marked tests, so that its
    multi-rank runs collect only those. Every rank collects on its own, and collecting the whole
    suite (importing PyTorch, scikit-learn, every kernel) took 13-25 s of CPU per rank."""
    listing = os.environ.get("HPCGRAD_TEST_MPI_FILES")
    if not listing or comm_world().Get_size() > 1:
        return
    for marker, path in (("mpi", listing), ("four_ranks", listing + ".four_ranks")):
        files = sorted({os.path.relpath(str(item.path)) for item in session.items
                        if item.get_closest_marker("mpi") is not None
                        and item.get_closest_marker(marker) is not None})
        with open(path, "w") as out:
            out.write("".join(f"{name}\n" for name in files))


@pytest.fixture
def launch():
    """run_job, for tests that start their own processes; skipped inside a multi-rank run (it would run once per rank)."""
    if comm_world().Get_size() > 1:
        pytest.skip("launches its own processes; runs in the serial suite")
    return run_job


_torch_outcomes = {}


def pytest_runtest_logreport(report):
    if "torch_reference" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _torch_outcomes.setdefault(report.nodeid, report.outcome)


def pytest_terminal_summary(terminalreporter):
    """One line: how many PyTorch-comparison tests ran here (CI installs torch 2.13.0 CPU)."""
    if not _torch_outcomes:
        return
    counts = {}
    for outcome in _torch_outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    try:
        import torch
        have = f"torch {torch.__version__}"
    except ImportError:
        have = "torch not installed: pip install -e '.[reference]'"
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    terminalreporter.write_line(f"PyTorch reference tests ({have}): {len(_torch_outcomes)} "
                                f"compared with PyTorch: {detail}")
