"""The training loop a job runs on: resume, preemption and requeue, checkpoints, metrics, progress, timeline.

Note [One training loop]
    A job (jobs/*.py) is a model, a step and an evaluation: a ``Job`` says how to iterate an
    epoch's batches, what one step does and what an epoch's end reports, and ``Loop`` does the
    rest the same way for every job:

    - start and end: ``start`` begins every job's main (the process group; with --resume the
      saved run found and the job asked whether it can continue it, before the model and data
      are made), ``exit_job`` ends its process (every rank together);
    - resume: ``--resume`` loads the checkpoint into the model and optimizer, hands the rest of
      it to ``Job.restore``, skips the batches the epoch already trained, and says so; a
      complete run says there is nothing to train (and ``Job.begin`` is never called);
    - stop: SIGTERM, SIGUSR1 or SIGINT on any rank (``Preemption``: the ranks agree at each
      step's end), or ``--max-steps``: a checkpoint, <checkpoint-dir>/PREEMPTED unless the run
      simply reached --max-steps, one line, and the exit status ``stop_status`` (128 + the
      signal) that slurm/train_ddp.sbatch requeues on;
    - checkpoints every --checkpoint-every steps and at each epoch's end, with what
      ``Job.checkpoint_state`` adds (called on every rank: it may be collective, as
      consolidating ZeRO's shards); a failure ends every rank with status 1. Where they go is
      ``start``'s choice: ``LastFile``, <checkpoint-dir>/last.npz written by rank 0 atomically
      (the ranks hold the same model), or ``Commits``, multi-part commits in which every rank
      saves its own part (a pipeline's stages);
    - metrics.jsonl (and TensorBoard with --tensorboard), a progress bar on a terminal, the
      epoch line on rank 0, and the timeline merged on every normal exit.

    A job whose ranks differ (jobs/train_pipeline.py: one stage each, the loss on the last)
    sets ``Job.preemption = LatePreemption`` (the agreement, which also brings the loss to rank
    0, waited for a step late, so no rank spins while the others finish the step; the steps'
    metrics are written once agreed), returns a "loss" among its epoch figures (over the whole
    epoch, kept across a resume), uses ``Commits``, and starts and stops what only training
    needs (its RPC agent) in ``Job.begin`` and ``Job.finish``.

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
from hpcgrad.data import DataLoader, DistributedSampler, Sampler
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

    def exchange(self, step, loss, extra, last=False):
        """At the end of step ``step`` (its ``loss`` and other metrics ``extra``), every rank:
        agree on a stop (``stopped_by``) and return the steps now agreed, [(step, loss,
        extra)], which the loop records. Here each step is agreed at its end; ``last`` (an
        epoch's last step, --max-steps reached) matters to ``LatePreemption`` only."""
        self.agreed()
        return [(step, loss, extra)]


class LatePreemption(Preemption):
    """``Preemption`` agreed one step late: the agreement for step k (one tiny all-reduce on
    the world, which also brings the step's loss to rank 0) is posted at its end and waited for
    after step k + 1. For a job whose ranks finish a step at different times (a pipeline): a
    blocking agreement had rank 0 spin in MPI_Wait through the other stages' backward (on 3
    ranks sharing 2 cores that doubled the epoch time); by the next step's end every rank has
    posted it, so the wait returns at once. A signal thus stops the job one step later, on
    every rank alike. The loss recorded is the largest any rank passed: a job whose loss is
    known on one rank (the pipeline's last stage) passes 0 on the others (a loss is >= 0);
    ``extra`` is this rank's."""

    def __init__(self):
        super().__init__()
        self._pending = None  # (step, values, work, extra) of the agreement in flight

    def exchange(self, step, loss, extra, last=False):
        """Post ``step``'s agreement and return the previous step's, if any; with ``last``, or
        once a signal is agreed, this step's too: no agreement stays in flight past an epoch's
        end or a stop."""
        values = np.array([float(self.signum), loss])
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        done, self._pending = self._settle(), (step, values, work, extra)
        if last or self.stopped_by:
            done += self._settle()
        return done

    def _settle(self):
        """Wait for the agreement in flight, if any: [(step, loss, extra)], or []."""
        if self._pending is None:
            return []
        step, values, work, extra = self._pending
        self._pending = None
        work.wait()
        self.stopped_by = max(self.stopped_by, int(values[0]))
        return [(step, float(values[1]), extra)]


def stopped_line(step, path, signum):
    """'stopped at step 30 by SIGTERM (exit status 143); checkpoint ...' (rank 0 prints it)."""
    why = f" by {signal.Signals(signum).name} (exit status {stop_status(signum)})" if signum else ""
    return f"\nstopped at step {step}{why}; checkpoint {path}; continue with --resume"


# --- where a run's checkpoints live -------------------------------------------------------------
class LastFile:
    """A run's checkpoint as one file, <checkpoint-dir>/last.npz, written by rank 0 alone
    (atomically): the model and optimizer are alike on every rank (DDP; ZeRO's shards
    consolidated on rank 0 by ``Job.checkpoint_state``), and rank 0's ``checkpoint_state``
    goes in. Every method is called by every rank."""

    def __init__(self, directory, prog):
        self.directory, self.prog = directory, prog
        self.path = os.path.join(directory, CHECKPOINT)  # what the resumed and stopped lines name

    def find(self):
        """With --resume, before the model is made: the checkpoint's ``extra`` values, or the
        job ends on every rank with one line (``resume_extra``)."""
        return resume_extra(self.path, self.prog)

    def load(self, model, optimizer):
        """Restore ``model`` and ``optimizer``; the checkpoint's values (a failure: one line,
        status 1 on every rank)."""
        meta, problem = None, None
        try:
            meta = checkpoint.load(self.path, model, optimizer)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, self.prog, "loading the checkpoint", status=1)
        return meta

    def save(self, model, optimizer, values):
        """Save with ``values`` (position, arguments, the job's state); the path. Nobody reads
        or overwrites it before it is complete; a failure ends every rank with status 1."""
        problem = None
        if dist.get_rank() == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                checkpoint.save(self.path, model, optimizer, **values)
            except (checkpoint.CheckpointError, OSError) as exc:
                problem = str(exc)
        stop_if_any(problem, self.prog, "saving the checkpoint", status=1)
        return self.path


class Commits(LastFile):
    """A run's checkpoints as multi-part commits (Note [Multi-part commit] in checkpoint.py):
    every rank saves its own part (its model and optimizer, its ``checkpoint_state``), rank 0
    commits a manifest, commit-<n>.json, once every part is durable, and a resume takes the
    newest complete commit. For a job whose ranks hold different state (a pipeline's stages)."""

    def __init__(self, directory, prog):
        super().__init__(directory, prog)
        self.path = directory  # then the newest commit's manifest, once loaded or saved
        self._found = None  # [the Commit find returned]

    def find(self):
        """With --resume, before the model is made: the newest complete commit, or None where
        the directory holds none; a directory it cannot use (status 2) or commits all damaged
        (status 1) end the job on every rank with one line."""
        stop_if_any(unwritable(self.directory), self.prog, "checking the set-up")
        commit, problem = None, None
        try:
            commit = checkpoint.find_commit(self.directory)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, self.prog, "reading the checkpoint", status=1)
        self._found = [commit]
        return commit

    def load(self, model, optimizer):
        """Restore this rank's part of the commit ``find`` found; rank 0 says which newer
        commits and parts it passed over."""
        commit = (self._found or [self.find()])[0]
        stop_if_any(None if commit else f"--resume: no checkpoint (commit-*.json) in "
                    f"{self.directory}; run without --resume first", self.prog,
                    "looking for the checkpoint")
        meta, problem = None, None
        try:
            meta = checkpoint.load_commit(commit, model, optimizer)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, self.prog, "loading the checkpoint", status=1)
        for skipped in commit.skipped:
            say(f"note: skipped a newer commit, {skipped}")
        newer = checkpoint.newer_uncommitted_steps(self.directory, commit) \
            if dist.get_rank() == 0 else None
        if newer:
            say(f"note: ignored the parts of step(s) {', '.join(map(str, newer))}: a save "
                "stopped before every stage had committed it")
        self.path = os.path.join(self.directory, commit.name)
        return meta

    def save(self, model, optimizer, values):
        """Save this rank's part and commit it (collective); the manifest's path. A failure,
        found by every rank alike, ends the job with one line (status 1), the last commit
        standing."""
        name, problem = None, None
        try:
            name = checkpoint.save_parts(self.directory, model, optimizer, **values)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, self.prog, "saving the checkpoint", status=1)
        self.path = os.path.join(self.directory, name)
        return self.path


# --- what jobs share ----------------------------------------------------------------------------
def start(args, prog, problem=None, checkpoints=LastFile, **group):
    """The start of a job's ``main``, on every rank: the process group up (``group``:
    init_process_group's arguments) and, with --resume, the saved run found (``checkpoints``,
    LastFile or Commits, for args.checkpoint_dir: ``find``) and ``problem(saved, path, world)``
    asked why it cannot continue this run (None: it can), before the job makes its model and
    loads its data (load_digits imports scikit-learn: seconds per rank); a run that cannot
    continue ends there with one line, status 2. Returns (rank, world, the checkpoints, for
    ``Loop``)."""
    dist.init_process_group(**group)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = checkpoints(args.checkpoint_dir, prog)
    if args.resume:
        saved = store.find()
        if problem is not None:
            stop_if_any(problem(saved, store.path, world), prog, "checking the checkpoint")
    return rank, world, store


def say(text, file=None):
    """Rank 0 prints ``text`` (a header computed collectively, a note; to ``file``, default
    stdout), the others nothing; before or after init_process_group."""
    if comm_world().Get_rank() == 0:
        print(text, file=file, flush=True)


def exit_job(status):
    """The end of a job's process, ``status`` being main's (the same on every rank): a
    preemption notice arriving now is ignored, and every rank exits together."""
    Preemption.ignore_from_now()
    exit_together(status)


def loaders(args, train, test):
    """(sampler, train loader, test loader) of a data-parallel job: each rank its
    DistributedSampler shard of ``train`` in batches of --batch-size, and its EvaluationShard
    of ``test``."""
    sampler = DistributedSampler(train, seed=args.seed)
    shard = EvaluationShard(len(test), dist.get_rank(), dist.get_world_size())
    return (sampler, DataLoader(train, batch_size=args.batch_size, sampler=sampler),
            DataLoader(test, batch_size=256, sampler=shard))


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
    # How the ranks agree on a stop: at each step's end, or LatePreemption's one step late.
    preemption = Preemption

    def begin(self):
        """Every rank, once the loop knows this run trains (after a resume), before its first
        step: what training needs and a run with nothing to train should not start."""

    def batches(self, epoch):
        """The epoch's batches, in order (the loop skips those a resumed run already did)."""
        raise NotImplementedError

    def step(self, batch, step):
        """Train on ``batch`` (the run's step number ``step``, from 1): (loss as a float, the
        samples it held, {other per-step metrics}). The epoch's loss is the mean of every
        rank's step losses, its samples their sum."""
        raise NotImplementedError

    def end_epoch(self, epoch):
        """At the end of epoch ``epoch`` (from 0), before its checkpoint, every rank: ({figures
        for metrics.jsonl}, the words the epoch line shows between the loss and the time, as
        rank 0 has them). A "loss" among the figures is the epoch's training loss over the
        whole epoch, kept across a resume in ``checkpoint_state``: the loop reports it instead
        of the mean of this run's steps."""
        return {}, ""

    def checkpoint_state(self):
        """What the checkpoint holds beyond the model, optimizer and position (every rank
        calls it: it may be collective)."""
        return {}

    def restore(self, meta):
        """Take back what ``checkpoint_state`` saved (``meta``: the checkpoint's values)."""

    def world_changed(self, state, change):
        """An elastic run lost ranks (Note [Elastic training loop]): every survivor, after the
        newest commit was restored, follows the new world (``state.ddp``, its rank and size)."""

    def first_epoch_note(self):
        """A line rank 0 prints after the first epoch's (or None)."""
        return None

    def finish(self):
        """Every rank, after the last epoch of a run that trained to its end (not after a
        stop), before the timeline is merged: ``begin``'s counterpart."""


class Loop:
    """Runs ``job`` for ``args.epochs`` epochs of ``steps_per_epoch`` steps on ``model`` and
    ``optimizer`` (Note [One training loop]); ``args``: the run arguments of jobs/job_args.py
    (epochs, checkpoint_dir, checkpoint_every, resume, max_steps, no_progress, tensorboard);
    ``checkpoints``: ``start``'s (default: a LastFile in args.checkpoint_dir)."""

    def __init__(self, job, args, model, optimizer, steps_per_epoch, checkpoints=None):
        self.job, self.args, self.model, self.optimizer = job, args, model, optimizer
        self.steps_per_epoch = steps_per_epoch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.checkpoints = checkpoints or LastFile(args.checkpoint_dir, job.prog)
        self.marker = os.path.join(args.checkpoint_dir, PREEMPTED)
        self.step, self.epoch, self.skip = 0, 0, 0
        self.finished = False  # trained to the last epoch's end in this run

    def resume(self):
        """Load the checkpoint (with --resume): False when the run is already complete."""
        if not self.args.resume:
            return True
        meta = self.resumed_meta = self.checkpoints.load(self.model, self.optimizer)
        self.step, self.epoch, self.skip = meta["step"], meta["epoch"], meta["batches_done"]
        self.job.restore(meta)
        say(f"resumed from {self.checkpoints.path}: epoch {self.epoch}, step {self.step}")
        if self.epoch < self.args.epochs:
            return True
        say(f"the run in {self.args.checkpoint_dir} is complete ({self.epoch} of "
            f"{self.args.epochs} epochs); nothing to train. Raise --epochs to train on, or use "
            "a new --checkpoint-dir for a new run")
        if self.rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)
        return False

    def save(self, epoch, batches_done):
        values = dict(step=self.step, epoch=epoch, batches_done=batches_done,
                      world_size=self.world, args=vars(self.args), **self._place(epoch))
        with TIMELINE.span("checkpoint", "step", step=self.step):
            self.checkpoints.save(self.model, self.optimizer,
                                  {**values, **self.job.checkpoint_state()})

    def run(self):
        """Train; the job's exit status (0, or 128 + the signal that stopped it)."""
        if not self.resume():
            return 0
        if self.rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)  # this run continues the preempted one
        args = self.args
        self.job.begin()
        self.preemption = self.job.preemption()
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
            status = self._train()
            if status is not None:
                return status
        finally:
            self.metrics.close()
            if self.progress is not None:
                self.progress.close()
        self.job.finish()
        finish_timeline(dist.barrier, self.rank)  # every rank's part, merged by rank 0
        self.finished = True
        return 0

    def _place(self, epoch):
        """What the checkpoint says of the place in the epoch beyond ``batches_done``."""
        return {}

    def _train(self):
        """The epochs from ``self.epoch`` on: an exit status if the run stops, else None."""
        for epoch in range(self.epoch, self.args.epochs):
            status = self._epoch(epoch)
            if status is not None:
                return status
        return None

    def _batches(self, epoch):
        """(the epoch's batches, how many the epoch has in all)."""
        return self.job.batches(epoch), self.steps_per_epoch

    def _stepped(self, count):
        """After each step (``count``: the samples it held on this rank)."""

    def _write(self, text):
        (self.progress.write if self.progress is not None else print)(text, flush=True)

    def _epoch(self, epoch):
        """One epoch; an exit status if the run stops in it, else None."""
        args, job = self.args, self.job
        losses, samples, epoch_started = [], 0, time.perf_counter()
        stop = False
        batches, steps = self._batches(epoch)
        for batch, data in enumerate(batches):
            if batch < self.skip:
                continue  # already trained before the checkpoint we resumed from
            with TIMELINE.span("step", "step", step=self.step + 1):
                loss, count, extra = job.step(data, self.step + 1)
            self.step += 1
            self._stepped(count)
            losses.append(loss)
            samples += count
            reached = bool(args.max_steps and self.step >= args.max_steps)
            last = reached or batch + 1 == steps
            for step, agreed_loss, agreed_extra in self.preemption.exchange(self.step, loss,
                                                                            extra, last):
                self._record(step, epoch, agreed_loss, agreed_extra)
            stop = bool(self.preemption.stopped_by) or reached
            if batch + 1 == steps:
                break  # the epoch's end saves (and stops, if asked to) after its report
            if stop or (args.checkpoint_every and self.step % args.checkpoint_every == 0):
                self.save(epoch, batch + 1)
            if stop:
                return self._stopped()
        elapsed = time.perf_counter() - epoch_started
        # Loss and samples of the steps this run made: after a mid-epoch resume, a part.
        totals = np.array([sum(losses), len(losses), samples])
        dist.all_reduce(totals)
        rate = totals[2] / elapsed if elapsed > 0 else float("nan")
        figures, words = job.end_epoch(epoch)
        figures = dict(figures)
        whole = "loss" in figures  # the job's loss over the whole epoch, even if resumed
        train_loss = figures.pop("loss") if whole else totals[0] / max(totals[1], 1)
        self.save(epoch + 1, 0)
        partial, resumed = "", ""
        if self.skip and whole:
            resumed = (f" (resumed after step {self.skip} of {self.steps_per_epoch}: figures "
                       "over the whole epoch, time over this run's part)")
        elif self.skip:
            partial = f" (steps {self.skip + 1}-{self.steps_per_epoch} only: resumed)"
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
                        f"({time.perf_counter() - self.started:.1f} s){resumed}")
            note = job.first_epoch_note() if first else None
            if note:
                self._write(note)
        return self._stopped() if stop else None

    def _record(self, step, epoch, loss, extra):
        """Step ``step``'s metrics, once the ranks have agreed on it."""
        self.metrics.write("step", step, epoch, time.perf_counter() - self.started, loss=loss,
                           **extra)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(epoch=epoch, loss=f"{loss:.3f}")

    def _stopped(self):
        """After the stop's checkpoint: the marker (unless --max-steps was simply reached), the
        line, the timeline, and the exit status."""
        args = self.args
        status = stop_status(self.preemption.stopped_by)
        if self.rank == 0:
            if status or not args.max_steps or self.step < args.max_steps:
                open(self.marker, "w").close()  # requeue me (slurm/train_ddp.sbatch)
            print(stopped_line(self.step, self.checkpoints.path, self.preemption.stopped_by),
                  flush=True)
        finish_timeline(dist.barrier, self.rank)
        return status
