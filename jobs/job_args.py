"""The jobs' command lines and exits: a nonsense value is an argparse error (exit 2) that says
what was expected, what came and what to pass instead, printed once; every rank agrees before it
exits (Note [Exit status] in hpcgrad/comm/mpi.py), so no exit needs MPI_Abort.

Exit statuses of jobs/*.py (the table in docs/distributed.rst):
    0    done (or --max-steps reached, or nothing left to train)
    1    a checkpoint could not be written or read (one line on rank 0); an uncaught exception
         (MPI_Abort with the rank's traceback)
    2    usage: a bad argument, or a run that cannot start (too large a batch, an unwritable
         --checkpoint-dir, --resume without a checkpoint, another number of ranks)
    128+N  stopped by signal N after a checkpoint, resumable with --resume: 130 SIGINT (Ctrl-C),
         138 SIGUSR1 (SLURM's --signal=USR1 notice), 143 SIGTERM (preemption, scancel); the
         shell's and SLURM's reading of a job a signal ended. <checkpoint-dir>/PREEMPTED is left.
"""

import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys
import time

import numpy as np

from hpcgrad.comm.mpi import abort_job, comm_world, exit_together
from hpcgrad.comm.work import default_timeout

# The signals a job stops at (checkpoint, then 128 + the number); on two ranks' different
# signals the job exits with the larger number (TERM over USR1 over INT).
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)


def counted(n, thing):
    """'1 rank', '2 ranks': a count and its noun."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def stop_status(signum):
    """The exit status of a job stopped by ``signum`` (0: not by a signal)."""
    return 128 + signum if signum else 0


def agree(problem, what):
    """Every rank of the job passes its ``problem`` (a str) or None; every rank gets (rank,
    problem) of the lowest rank that has one, or None. Collective over COMM_WORLD, before or
    after init_process_group; the wait is bounded by HPCGRAD_COMM_TIMEOUT (default 30 min):
    a rank that never arrives ends the job with MPI_Abort saying ``what`` was waited for."""
    comm = comm_world()
    if comm.Get_size() == 1:
        return None if problem is None else (0, problem)
    data = np.frombuffer(bytearray((problem or "").encode("utf-8")), np.uint8)
    lengths = np.empty(comm.Get_size(), np.int64)
    timeout = default_timeout()
    deadline = time.monotonic() + timeout if timeout else None
    _bounded(comm.Iallgather(np.array([-1 if problem is None else data.size], np.int64), lengths),
             deadline, timeout, what)
    failing = [r for r, n in enumerate(lengths) if n >= 0]
    if not failing:
        return None
    root = failing[0]
    text = data.copy() if comm.Get_rank() == root else np.empty(int(lengths[root]), np.uint8)
    _bounded(comm.Ibcast(text, root=root), deadline, timeout, what)
    return root, text.tobytes().decode("utf-8")


def _bounded(request, deadline, timeout, what):
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            abort_job([f"{what}: not every rank arrived within {timeout:g} s "
                       f"(HPCGRAD_COMM_TIMEOUT); a rank failed before it or hangs"])
        time.sleep(0.002)


def stop_if_any(problem, prog, what, status=2):
    """Collective: if any rank has a ``problem``, rank 0 prints one line, '<prog>: error:
    <problem>' (naming the rank if not every rank found it), and every rank exits with
    ``status``, without a traceback or MPI_Abort; else return."""
    agreed = agree(problem, what)
    if agreed is None:
        return
    if comm_world().Get_rank() == 0:
        root, text = agreed
        where = "" if root == 0 else f"rank {root}: "
        print(f"{prog}: error: {where}{text}", file=sys.stderr, flush=True)
    exit_together(status)


def parse_together(parser, argv=None):
    """``parser.parse_args(argv)`` on every rank, its output (usage and error, or --help)
    printed once, by rank 0, and the exit (2, or 0 for --help) taken by every rank together."""
    out, err = io.StringIO(), io.StringIO()
    outcome = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        outcome = json.dumps([status, out.getvalue(), err.getvalue()])
    agreed = agree(outcome, "checking the command line")
    if agreed is None:
        return args
    status, stdout, stderr = json.loads(agreed[1])
    if comm_world().Get_rank() == 0:
        sys.stdout.write(stdout)
        sys.stdout.flush()
        sys.stderr.write(stderr)
        sys.stderr.flush()
    exit_together(status)


def integer(minimum, what, example):
    """An int >= ``minimum``; ``what`` names the value, ``example`` is a good one."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum} ({what}), got {text!r}; for example {example}")
        return value
    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in some messages
    return parse


def real(what, example, positive=False, below=None):
    """A finite float, > 0 with ``positive``, else >= 0 (no nan, no inf); < ``below`` if given."""
    bound = "> 0" if positive else ">= 0"
    if below is not None:
        bound += f" and < {below:g}"

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value < 0 or (positive and value == 0)
                or (below is not None and value >= below)):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {bound} ({what}), got {text!r}; for example {example}")
        return value
    parse.__name__ = f"number {bound}"
    return parse


def directory(text):
    """A directory path, existing or to be created: not empty, not an existing file (found
    here, before training, rather than by rank 0 alone at its first save)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory path, got ''; for example "
                                         "checkpoints")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}, which is a "
                                         f"file; pass another path (it is created if missing)")
    return text


def training_parser(description, *, epochs, batch_help, lr_help, seed_help):
    """The arguments every training job takes (defaults shown in --help); the job adds its own."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=integer(1, "epochs to train", epochs), default=epochs,
                   help="epochs to train in all (a resumed run continues to this many)")
    p.add_argument("--batch-size", type=integer(1, "samples per step", 32), default=32,
                   help=batch_help)
    p.add_argument("--lr", type=real("the learning rate", 0.05, positive=True), default=0.05,
                   help=lr_help)
    p.add_argument("--momentum", type=real("SGD momentum", 0.9, below=1), default=0.9,
                   help="SGD momentum, in [0, 1)")
    p.add_argument("--seed", type=integer(0, "the random seed", 0), default=0, help=seed_help)
    return p


def add_run_arguments(p, *, checkpoint_dir, checkpoint_help, resume_help):
    """Checkpoints, resume and stopping: the arguments after a job's own."""
    p.add_argument("--checkpoint-dir", type=directory, default=checkpoint_dir,
                   help=checkpoint_help)
    p.add_argument("--checkpoint-every", type=integer(0, "steps between checkpoints", 50),
                   default=50, help="steps (0: epoch ends only)")
    p.add_argument("--resume", action="store_true", help=resume_help)
    p.add_argument("--max-steps", type=integer(0, "steps before stopping, 0: no limit", 30),
                   default=0, help="stop after this many steps (tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--tensorboard", action=_TensorBoard, nargs=0, default=False,
                   help="also write the metrics as TensorBoard events in "
                        "<checkpoint-dir>/tensorboard (needs tensorboardX)")
    return p


class _TensorBoard(argparse.Action):
    """--tensorboard: refused at parsing, on every rank alike, where tensorboardX is missing."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            parser.error("--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'")
        setattr(namespace, self.dest, True)


def unwritable(checkpoint_dir):
    """Why ``checkpoint_dir`` cannot take checkpoints (made if missing), or None: checked by
    every rank before training, not found by rank 0 at its first save."""
    probe = os.path.join(checkpoint_dir, f".write-test.{os.uname().nodename}.{os.getpid()}")
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        return (f"--checkpoint-dir {checkpoint_dir} is not writable ({error.strerror}); "
                "pass a directory you can write")
    return None
