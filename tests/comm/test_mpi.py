"""Tests for hpcgrad.comm.mpi: thread level, the CUDA-awareness decision, the abort-on-exception
hook and the output drained before an abort."""

import io
import os
import sys
import threading
from pathlib import Path

import pytest

import hpcgrad.comm.mpi
from hpcgrad.comm.mpi import (
    MPI,
    comm_world,
    cuda_aware_mpi,
    drain_output,
    install_abort_hook,
    thread_level,
    unread_bytes,
)

SCRIPT = Path(__file__).parents[1] / "scripts" / "raise_on_rank1.py"
MESSAGE = "injected failure on rank 1"


def test_thread_level_is_multiple():
    assert thread_level() == "multiple"


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True)])
def test_cuda_aware_env_override(monkeypatch, value, expected):
    monkeypatch.setenv("HPCGRAD_CUDA_AWARE_MPI", value)
    aware, reason = cuda_aware_mpi()
    assert aware is expected
    assert f"HPCGRAD_CUDA_AWARE_MPI={value}" in reason


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_cuda_aware_env_rejects_bad_value(monkeypatch, value):
    monkeypatch.setenv("HPCGRAD_CUDA_AWARE_MPI", value)
    with pytest.raises(ValueError, match=rf"must be '0' or '1', got '{value}'.*unset it"):
        cuda_aware_mpi()


def test_cuda_aware_queries_loaded_library(monkeypatch):
    monkeypatch.delenv("HPCGRAD_CUDA_AWARE_MPI", raising=False)
    aware, reason = cuda_aware_mpi()
    assert isinstance(aware, bool) and reason
    if "pypi.org/p/mpich" in MPI.Get_library_version():  # the pip wheel is built without CUDA
        assert not aware
        assert "MPIX_Query_cuda_support() returned 0" in reason


def test_cuda_aware_without_query(monkeypatch):
    monkeypatch.delenv("HPCGRAD_CUDA_AWARE_MPI", raising=False)
    monkeypatch.setattr(hpcgrad.comm.mpi, "_loaded_mpi_libraries", lambda: [])
    assert cuda_aware_mpi() == (False, "no query available -> assume not CUDA-aware")


@pytest.fixture
def fresh_hooks(monkeypatch):
    """Let a test install the abort hook and restore the previous hooks afterwards."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.setattr(hpcgrad.comm.mpi, "_last_exit", None)
    monkeypatch.setattr(hpcgrad.comm.mpi, "_installed", False)
    monkeypatch.delenv("HPCGRAD_NO_ABORT_HOOK", raising=False)
    return monkeypatch


def test_install_abort_hook_is_idempotent(fresh_hooks):
    assert install_abort_hook()
    hooks = sys.excepthook, threading.excepthook
    assert install_abort_hook()
    assert (sys.excepthook, threading.excepthook) == hooks


def test_install_abort_hook_opt_out(fresh_hooks):
    fresh_hooks.setenv("HPCGRAD_NO_ABORT_HOOK", "1")
    before = sys.excepthook, threading.excepthook, sys.exit
    assert not install_abort_hook()
    assert (sys.excepthook, threading.excepthook, sys.exit) == before


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (2, 2), (True, 1), ("bad input", 1)])
def test_exit_status_as_python_computes_it(code, status):
    assert hpcgrad.comm.mpi._exit_status(SystemExit(code)) == status


def _swallowed_exit():
    with pytest.raises(SystemExit) as caught:
        sys.exit(4)
    return caught.value


def _exit_through_finally():
    try:
        sys.exit(6)
    finally:
        pass


class _ExitsWhenDeleted:
    def __del__(self):  # Python prints what __del__ raises, and no Python handler sees it
        _exit_through_finally()


def test_sys_exit_is_recorded_and_a_caught_one_ends_nothing(fresh_hooks):
    """Note [Exit status]: the wrapper raises what sys.exit raises and remembers it; a frame
    that handled it and returned means the program went on."""
    install_abort_hook()
    assert sys.exit.__name__ == "exit" and sys.exit.__doc__
    exc = _swallowed_exit()
    assert exc.code == 4 and hpcgrad.comm.mpi._last_exit is exc
    assert hpcgrad.comm.mpi._failed_exit() is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_sys_exit_that_left_its_handler_is_what_ends_the_program(fresh_hooks):
    """A ``finally`` (or ``with``) block handles the SystemExit and lets it go on: if no
    Python code handles it after (here C code swallows it, as Python's exit does), it is
    the process's exit status."""
    install_abort_hook()
    _ExitsWhenDeleted()
    line = _exit_through_finally.__code__.co_firstlineno + 2
    where = f"sys.exit(6) at {__file__}:{line} in _exit_through_finally"
    assert hpcgrad.comm.mpi._failed_exit() == (6, where)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_sys_exit_in_a_thread_is_not_recorded(fresh_hooks):
    install_abort_hook()
    thread = threading.Thread(target=sys.exit, args=(5,))
    thread.start()
    thread.join(10)
    assert hpcgrad.comm.mpi._last_exit is None


def test_abort_hook_defers_to_previous_hook_on_one_rank():
    if comm_world().Get_size() > 1:
        pytest.skip("at size > 1 the hook aborts the job")
    seen = []
    hpcgrad.comm.mpi._abort_on_exception(ValueError, ValueError("x"), None, lambda *a: seen.append(a))
    assert seen and seen[0][0] is ValueError


def run_raise_on_rank1(launch, *args, env=None, mpiexec_timeout=None):
    return launch([sys.executable, str(SCRIPT), *args], nprocs=2, env=env, timeout=60,
                  mpiexec_timeout=mpiexec_timeout)


@pytest.mark.parametrize("args", [(), ("--in-thread",)], ids=["main-thread", "other-thread"])
def test_uncaught_exception_aborts_every_rank(launch, args):
    job = run_raise_on_rank1(launch, *args)
    assert job.returncode not in (0, None), job.output
    assert not job.timed_out and job.elapsed < 15, f"took {job.elapsed:.1f} s:\n{job.output}"
    assert f"[rank 1] RuntimeError: {MESSAGE}" in job.stderr, job.output


def test_opt_out_prints_plain_traceback_and_needs_timeout(launch):
    job = run_raise_on_rank1(launch, env={"HPCGRAD_NO_ABORT_HOOK": "1"}, mpiexec_timeout=5)
    assert job.failed, job.output
    assert f"RuntimeError: {MESSAGE}" in job.stderr and "[rank 1]" not in job.stderr, job.output


@pytest.mark.parametrize("offload, mode, aware", [("1", "cuda", True), ("0", "cuda", False),
                                                  (None, None, False)])
def test_intel_mpi_is_cuda_aware_with_its_offload_on(monkeypatch, offload, mode, aware):
    """Intel MPI (the impi extra) takes device buffers only with I_MPI_OFFLOAD=1 and
    I_MPI_OFFLOAD_MODE=cuda, which no query reports: the decision reads them."""
    monkeypatch.delenv(hpcgrad.comm.mpi.CUDA_AWARE_ENV, raising=False)
    monkeypatch.setattr(hpcgrad.comm.mpi.MPI, "Get_library_version",
                        lambda: "Intel(R) MPI Library 2021.18.1 for Linux* OS\n")
    for name, value in (("I_MPI_OFFLOAD", offload), ("I_MPI_OFFLOAD_MODE", mode)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    result, reason = cuda_aware_mpi()
    assert result is aware and reason.startswith("Intel MPI with I_MPI_OFFLOAD=")
    assert aware or "set I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda" in reason


def _pipe_stream():
    read_end, write_end = os.pipe()
    return read_end, os.fdopen(write_end, "w")


def test_drain_output_waits_until_the_reader_has_read():
    """Note [Output before MPI_Abort]: the abort waits until the launcher has the last lines."""
    read_end, stream = _pipe_stream()
    stream.write("[rank 0] the line that names the failure\n")  # buffered: drain flushes it
    got = []
    reader = threading.Timer(0.2, lambda: got.append(os.read(read_end, 4096)))
    reader.start()
    try:
        assert drain_output([stream], bound=10.0) is True  # returns once the pipe is empty,
        assert unread_bytes(stream.fileno()) == 0          # which the reader alone empties
    finally:
        reader.join()  # (its append follows its read: checked once it has run)
        stream.close()
        os.close(read_end)
    assert got == [b"[rank 0] the line that names the failure\n"]


def test_drain_output_is_bounded_when_nobody_reads():
    read_end, stream = _pipe_stream()
    stream.write("nobody reads this\n")
    try:
        assert drain_output([stream], bound=0.1) is False
        assert unread_bytes(stream.fileno()) == len("nobody reads this\n")
    finally:
        stream.close()
        os.close(read_end)


def test_drain_output_skips_files_and_streams_without_a_descriptor(tmp_path):
    with open(tmp_path / "out.txt", "w") as file:
        file.write("to a file\n")
        assert drain_output([file, io.StringIO()], bound=0.1) is True
        assert unread_bytes(file.fileno()) == 0
    assert (tmp_path / "out.txt").read_text() == "to a file\n"
