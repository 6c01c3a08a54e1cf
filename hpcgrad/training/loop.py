"""The training loop a job runs on: resume, preemption and requeue, checkpoints, metrics, progress, timeline.

Note [One training loop]
    A job (jobs/*.py) is a model, a step and an evaluation: a ``Job`` says how to iterate an
    epoch's batches, what one step does and what an epoch's end reports, and ``Loop`` does the
    rest the same way for every job:

    - resume: ``--resume`` loads <checkpoint-dir>/last.npz into the model and optimizer, hands
      the rest of the checkpoint to ``Job.restore``, skips the batches the epoch already
      trained, and says so; a complete run says there is nothing to train;
    - stop: SIGTERM, SIGUSR1 or SIGINT on any rank (``Preemption``: the ranks agree at each
      step's end), or ``--max-steps``: a checkpoint, <checkpoint-dir>/PREEMPTED unless the run
      simply reached --max-steps, one line, and the exit status ``stop_status`` (128 + the
      signal) that slurm/train_ddp.sbatch requeues on;
    - checkpoints every --checkpoint-every steps and at each epoch's end, written by rank 0
      atomically with what ``Job.checkpoint_state`` adds (called on every rank: it may be
      collective, as consolidating ZeRO's shards); a failure ends every rank with status 1;
    - metrics.jsonl (and TensorBoard with --tensorboard), a progress bar on a terminal, the
      epoch line on rank 0, and the timeline merged on every normal exit.

    Everything any rank must decide with the others (a problem, a stop) is agreed collectively
    first (``stop_if_any``, ``Preemption.agreed``), so no exit needs MPI_Abort.
"""

import os
import signal
import sys
import time

import numpy as np

from hpcgrad.training import checkpoint
from hpcgrad import collectives as dist
from hpcgrad.autograd import no_grad
from hpcgrad.comm.mpi import abort_job, comm_world, exit_together
from hpcgrad.comm.work import default_timeout
from hpcgrad.data import Sampler
from hpcgrad.training.metrics import MetricsLog
from hpcgrad.base.timeline import TIMELINE
from hpcgrad.base.timeline import finish as finish_timeline

PREEMPTED = "PREEMPTED"  # marker file: the last run stopped early and should be resumed
CHECKPOINT = "last.npz"
# The signals a job stops at (checkpoint, then 128 + the number); on two ranks' different
# signals the job exits with the larger number (TERM over USR1 over INT).
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)


def stop_status(signum):
    """The exit status of a job stopped by ``signum`` (0: not by a signal)."""
    return 128 + signum if signum else 0


# --- deciding together --------------------------------------------------------------------------
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


def check_setup(args, world, train):
    """What makes a run of ``args.batch_size`` per rank on data set ``train`` impossible,
    found before training (the same on every rank), or None."""
    per_rank = len(train) // world
    if args.batch_size > per_rank:
        return (f"--batch-size {args.batch_size} is larger than each rank's share of the "
                f"{len(train)} training samples ({per_rank} at {world} ranks); use at most "
                f"{per_rank}")
    return unwritable(args.checkpoint_dir)


def resume_extra(path, prog):
    """Every rank: the ``extra`` values of checkpoint ``path`` (checkpoint.read_extra's checks,
    restoring nothing), or job ``prog`` ends on every rank with one line: status 2 if there is
    no file, 1 if it is unreadable."""
    missing = None if os.path.exists(path) else (
        f"--resume: no checkpoint at {path}; run without --resume first, or point "
        "--checkpoint-dir at it")
    stop_if_any(missing, prog, "looking for the checkpoint")
    extra, problem = None, None
    try:
        extra = checkpoint.read_extra(path)
    except (checkpoint.CheckpointError, OSError) as exc:
        problem = str(exc)
    stop_if_any(problem, prog, "reading the checkpoint", status=1)
    return extra


# --- stopping -----------------------------------------------------------------------------------
class Preemption:
    """SIGTERM/SIGUSR1/SIGINT set a flag; ranks agree on it at step boundaries (one tiny
    all-reduce), so Ctrl-C checkpoints like a preemption instead of a traceback per rank, and
    the job exits with ``stop_status`` of the largest signal number any rank received."""

    def __init__(self):
        self.signum = 0  # the largest stop signal this rank received
        self.stopped_by = 0  # the largest any rank received, once agreed
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    @property
    def requested(self):
        return bool(self.signum)

    def _handle(self, signum, frame):
        self.signum = max(self.signum, int(signum))

    @staticmethod
    def ignore_from_now():
        """The run is over: a preemption notice arriving now (SLURM's USR1 shortly before the
        time limit, a TERM) must not turn a finished job into a failed one, as it would while the
        interpreter shuts down, once Python's handlers are gone."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)

    def agreed(self):
        """The largest stop signal any rank received (0: none). Every rank calls it."""
        flag = np.array([float(self.signum)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopped_by = int(flag[0])
        return self.stopped_by


def stopped_line(step, path, signum):
    """'stopped at step 30 by SIGTERM (exit status 143); checkpoint ...' (rank 0 prints it)."""
    why = f" by {signal.Signals(signum).name} (exit status {stop_status(signum)})" if signum else ""
    return f"\nstopped at step {step}{why}; checkpoint {path}; continue with --resume"


# --- what jobs share ----------------------------------------------------------------------------
class EvaluationShard(Sampler):
    """Indices rank, rank + world, ...: every sample on exactly one rank (DistributedSampler
    pads to equal shards, which counts a sample twice in an evaluation)."""

    def __init__(self, size, rank, world):
        self.indices = range(rank, size, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def evaluate(model, loader, loss_fn):
    """(mean loss, accuracy) over every sample of ``loader``'s data set, each counted once
    (the ranks' sums all-reduced); ``loss_fn(logits, labels)`` is the mean loss of a batch."""
    model.eval()
    sums = np.zeros(3)  # loss sum, correct, samples
    with no_grad():
        for images, labels in loader:
            logits = model(images)
            n = len(labels.array)
            loss = loss_fn(logits, labels).item()
            sums += [loss * n, (logits.array.argmax(1) == labels.array).sum(), n]
    model.train()
    dist.all_reduce(sums)
    return sums[0] / sums[2], sums[1] / sums[2]


def hosts():
    """Every rank's (host name, pid), gathered (collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (os.uname().nodename, os.getpid()))
    return everyone


def rank_places(places, most=64):
    """'0 node1 pid 11, 1 node1 pid 12, ...': a launcher that reports a dead process by host and
    pid only (MPICH's hydra on SIGKILL) is traced back to its rank with this line."""
    shown = ", ".join(f"{rank} {host} pid {pid}" for rank, (host, pid) in enumerate(places[:most]))
    return shown + (f", ... ({len(places) - most} more)" if len(places) > most else "")


def counted(n, thing):
    """'1 rank', '2 ranks': a count and its noun."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


# --- the loop -----------------------------------------------------------------------------------
class Job:
    """What a job gives the loop (Note [One training loop]); override what applies."""

    prog = "job"
    # What the epoch line counts per second: (unit, units per sample that ``step`` counts).
    throughput = ("samples", 1)

    def batches(self, epoch):
        """The epoch's batches, in order (the loop skips those a resumed run already did)."""
        raise NotImplementedError

    def step(self, batch, step):
        """Train on ``batch`` (the run's step number ``step``, from 1): (loss as a float, the
        samples it held, {other per-step metrics})."""
        raise NotImplementedError

    def end_epoch(self, epoch):
        """At the end of epoch ``epoch`` (from 0), before its checkpoint: ({figures for
        metrics.jsonl}, the words the epoch line shows between the loss and the time)."""
        return {}, ""

    def checkpoint_state(self):
        """What the checkpoint holds beyond the model, optimizer and position (every rank
        calls it: it may be collective)."""
        return {}

    def restore(self, meta):
        """Take back what ``checkpoint_state`` saved (``meta``: the checkpoint's values)."""

    def first_epoch_note(self):
        """A line rank 0 prints after the first epoch's (or None)."""
        return None


class Loop:
    """Runs ``job`` for ``args.epochs`` epochs of ``steps_per_epoch`` steps on ``model`` and
    ``optimizer`` (Note [One training loop]); ``args``: the run arguments of jobs/job_args.py
    (epochs, checkpoint_dir, checkpoint_every, resume, max_steps, no_progress, tensorboard)."""

    def __init__(self, job, args, model, optimizer, steps_per_epoch):
        self.job, self.args, self.model, self.optimizer = job, args, model, optimizer
        self.steps_per_epoch = steps_per_epoch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.path = os.path.join(args.checkpoint_dir, CHECKPOINT)
        self.marker = os.path.join(args.checkpoint_dir, PREEMPTED)
        self.step, self.epoch, self.skip = 0, 0, 0
        self.finished = False  # trained to the last epoch's end in this run

    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def resume(self):
        """Load the checkpoint (with --resume): False when the run is already complete."""
        if not self.args.resume:
            return True
        meta, problem = None, None
        try:
            meta = checkpoint.load(self.path, self.model, self.optimizer)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, self.job.prog, "loading the checkpoint", status=1)
        self.step, self.epoch, self.skip = meta["step"], meta["epoch"], meta["batches_done"]
        self.job.restore(meta)
        self.say(f"resumed from {self.path}: epoch {self.epoch}, step {self.step}")
        if self.epoch < self.args.epochs:
            return True
        self.say(f"the run in {self.args.checkpoint_dir} is complete ({self.epoch} of "
                 f"{self.args.epochs} epochs); nothing to train. Raise --epochs to train on, "
                 "or use a new --checkpoint-dir for a new run")
        if self.rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)
        return False

    def save(self, epoch, batches_done):
        extra = self.job.checkpoint_state()
        problem = None
        if self.rank == 0:
            try:
                os.makedirs(self.args.checkpoint_dir, exist_ok=True)
                checkpoint.save(self.path, self.model, self.optimizer, step=self.step,
                                epoch=epoch, batches_done=batches_done, world_size=self.world,
                                args=vars(self.args), **extra)
            except (checkpoint.CheckpointError, OSError) as exc:
                problem = str(exc)
        # Nobody reads or overwrites it before it is complete; a failure ends every rank.
        stop_if_any(problem, self.job.prog, "saving the checkpoint", status=1)

    def run(self):
        """Train; the job's exit status (0, or 128 + the signal that stopped it)."""
        if not self.resume():
            return 0
        if self.rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)  # this run continues the preempted one
        args = self.args
        self.preemption = Preemption()
        self.metrics = MetricsLog(args.checkpoint_dir, self.rank, tensorboard=args.tensorboard,
                                  purge_step=self.step or None)
        self.progress = None
        # A bar only on a terminal: in a SLURM log its carriage returns are noise.
        if self.rank == 0 and not args.no_progress and sys.stdout.isatty():
            from tqdm import tqdm
            self.progress = tqdm(total=args.epochs * self.steps_per_epoch, initial=self.step,
                                 unit="step", dynamic_ncols=True, file=sys.stdout)
        self.started = time.perf_counter()
        try:
            for epoch in range(self.epoch, args.epochs):
                status = self._epoch(epoch)
                if status is not None:
                    return status
        finally:
            self.metrics.close()
            if self.progress is not None:
                self.progress.close()
        finish_timeline(dist.barrier, self.rank)  # every rank's part, merged by rank 0
        self.finished = True
        return 0

    def _write(self, text):
        (self.progress.write if self.progress is not None else print)(text, flush=True)

    def _epoch(self, epoch):
        """One epoch; an exit status if the run stops in it, else None."""
        args, job = self.args, self.job
        losses, samples, epoch_started = [], 0, time.perf_counter()
        stop = False
        for batch, data in enumerate(job.batches(epoch)):
            if batch < self.skip:
                continue  # already trained before the checkpoint we resumed from
            with TIMELINE.span("step", "step", step=self.step + 1):
                loss, count, extra = job.step(data, self.step + 1)
            self.step += 1
            losses.append(loss)
            samples += count
            self.metrics.write("step", self.step, epoch, time.perf_counter() - self.started,
                               loss=loss, **extra)
            if self.progress is not None:
                self.progress.update(1)
                self.progress.set_postfix(epoch=epoch, loss=f"{loss:.3f}")
            stop = self.preemption.agreed() or (args.max_steps and self.step >= args.max_steps)
            if batch + 1 == self.steps_per_epoch:
                break  # the epoch's end saves (and stops, if asked to) after its report
            if stop or (args.checkpoint_every and self.step % args.checkpoint_every == 0):
                with TIMELINE.span("checkpoint", "step", step=self.step):
                    self.save(epoch, batch + 1)
            if stop:
                return self._stopped()
        elapsed = time.perf_counter() - epoch_started
        # Loss and samples of the steps this run made: after a mid-epoch resume, a part.
        totals = np.array([sum(losses), len(losses), samples])
        dist.all_reduce(totals)
        train_loss = totals[0] / max(totals[1], 1)
        rate = totals[2] / elapsed if elapsed > 0 else float("nan")
        figures, words = job.end_epoch(epoch)
        with TIMELINE.span("checkpoint", "step", step=self.step):
            self.save(epoch + 1, 0)
        partial = "" if self.skip == 0 else \
            f" (steps {self.skip + 1}-{self.steps_per_epoch} only: resumed)"
        first = epoch == self.epoch
        self.skip = 0
        unit, per_sample = job.throughput
        rates = {"samples_per_s": rate}
        if unit != "samples":
            rates[f"{unit}_per_s"] = rate * per_sample
        self.metrics.write("epoch", self.step, epoch + 1, time.perf_counter() - self.started,
                           loss=train_loss, epoch_seconds=elapsed, **rates, **figures)
        if self.rank == 0:
            self._write(f"epoch {epoch + 1}/{args.epochs}  step {self.step}  loss "
                        f"{train_loss:.4f}{partial}  {words}  {elapsed:.2f} s  "
                        f"{rate * per_sample:,.0f} {unit}/s  "
                        f"({time.perf_counter() - self.started:.1f} s)")
            note = job.first_epoch_note() if first else None
            if note:
                self._write(note)
        return self._stopped() if stop else None

    def _stopped(self):
        """After the stop's checkpoint: the marker (unless --max-steps was simply reached), the
        line, the timeline, and the exit status."""
        args = self.args
        status = stop_status(self.preemption.stopped_by)
        if self.rank == 0:
            if status or not args.max_steps or self.step < args.max_steps:
                open(self.marker, "w").close()  # requeue me (slurm/train_ddp.sbatch)
            print(stopped_line(self.step, self.path, self.preemption.stopped_by), flush=True)
        finish_timeline(dist.barrier, self.rank)
        return status
