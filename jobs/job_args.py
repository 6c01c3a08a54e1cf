"""The jobs' command lines and exits: a nonsense value is an argparse error (exit 2) that says
what was expected, what came and what to pass instead, printed once; every rank agrees before it
exits (Note [Exit status] in hpcgrad/comm/mpi.py), so no exit needs MPI_Abort.

Exit statuses of jobs/*.py (the table in docs/distributed.rst):
    0    done (or --max-steps reached, or nothing left to train)
    1    a checkpoint could not be written or read (one line on rank 0); an uncaught exception
         (MPI_Abort with the rank's traceback)
    2    usage: a bad argument, or a run that cannot start (too large a batch, an unwritable
         --checkpoint-dir, --resume without a checkpoint, another number of ranks)
    75   with --elastic: the world shrank below --min-ranks after lost ranks; a checkpoint
         was saved and PREEMPTED left: resumable with --resume (EX_TEMPFAIL)
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
import sys

from hpcgrad.comm.mpi import comm_world, exit_together
from hpcgrad.training.loop import agree


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


def add_elastic_arguments(p):
    """--elastic and its settings (docs/elastic.rst): a data-parallel job that survives lost
    ranks under fault-tolerant MPI."""
    p.add_argument("--elastic", action="store_true",
                   help="go on without ranks that die (needs fault-tolerant MPI: the ft extra, "
                        "mpirun --with-ft ulfm; docs/elastic.rst)")
    p.add_argument("--min-ranks", type=integer(1, "fewest ranks to go on with", 2), default=1,
                   help="with --elastic: below this many ranks, checkpoint and exit 75 "
                        "(requeue)")
    p.add_argument("--commit-every", type=integer(1, "steps between in-memory commits", 10),
                   default=10, help="with --elastic: steps between in-memory commits (the "
                                    "steps a lost rank costs at most)")
    return p


class _TensorBoard(argparse.Action):
    """--tensorboard: refused at parsing, on every rank alike, where tensorboardX is missing."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            parser.error("--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'")
        setattr(namespace, self.dest, True)
