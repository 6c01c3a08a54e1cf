"""Data-parallel training of a small CNN or MLP on scikit-learn's digits, with resumable checkpoints.

    mpiexec -n 2 python jobs/train_ddp.py                  # train (a few seconds)
    mpiexec -n 2 python jobs/train_ddp.py --resume         # continue from checkpoints/last.npz
    sbatch slurm/train_ddp.sbatch                          # on a cluster

Each rank trains on its DistributedSampler shard; DistributedDataParallel averages gradients.
Rank 0 prints a header and one line per epoch (train loss, test loss and accuracy over every test
sample once, time, samples/s), shows a progress bar on a terminal, appends to
<checkpoint-dir>/metrics.jsonl (``python -m hpcgrad.plot <checkpoint-dir>`` draws it), and saves
checkpoints atomically every --checkpoint-every steps and at the end of each epoch. On SIGTERM,
SIGUSR1 or SIGINT (preemption, Ctrl-C) all ranks stop at the next step after a final checkpoint,
rank 0 leaves <checkpoint-dir>/PREEMPTED and the job exits with 128 + the signal's number
(jobs/job_args.py: the exit statuses), so --resume (or slurm/train_ddp.sbatch's requeue)
continues exactly where the job stopped. HPCGRAD_TIMELINE=path records a timeline of every rank.
"""

import os
import signal
import sys
import time

import numpy as np
from job_args import (
    counted,
    STOP_SIGNALS,
    add_run_arguments,
    parse_together,
    real,
    stop_if_any,
    stop_status,
    training_parser,
    unwritable,
)

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad import checkpoint, optim
from hpcgrad.comm.mpi import MPI, cuda_aware_mpi, exit_together
from hpcgrad.data import DataLoader, DistributedSampler, Sampler, load_digits
from hpcgrad.metrics import MetricsLog
from hpcgrad.nn.parallel import DistributedDataParallel
from hpcgrad.timeline import TIMELINE
from hpcgrad.timeline import finish as finish_timeline

PREEMPTED = "PREEMPTED"  # marker file: the last run stopped early and should be resumed
PROG = "train_ddp.py"


def build_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10))


def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0], epochs=8, batch_help="samples per rank and step",
                        lr_help="SGD learning rate",
                        seed_help="seed of the weights and the sampler")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="the network")
    p.add_argument("--bucket-cap-mb", type=real("DDP's bucket size in MB", 25, positive=True),
                   default=25, help="DDP's bucket size")
    add_run_arguments(p, checkpoint_dir="checkpoints",
                      checkpoint_help="checkpoints and metrics.jsonl of the run",
                      resume_help="continue from <checkpoint-dir>/last.npz")
    return parse_together(p, argv)


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


def resume_extra(path, prog=PROG):
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


class EvaluationShard(Sampler):
    """Indices rank, rank + world, ...: every sample on exactly one rank (DistributedSampler
    pads to equal shards, which counts a sample twice in an evaluation)."""

    def __init__(self, size, rank, world):
        self.indices = range(rank, size, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def evaluate(model, loader):
    """(mean loss, accuracy) over every sample of ``loader``'s data set, each counted once."""
    model.eval()
    sums = np.zeros(3)  # loss sum, correct, samples
    with hg.no_grad():
        for images, labels in loader:
            logits = model(images)
            n = len(labels.array)
            loss = F.cross_entropy(logits, labels).item()
            sums += [loss * n, (logits.array.argmax(1) == labels.array).sum(), n]
    model.train()
    dist.all_reduce(sums)
    return sums[0] / sums[2], sums[1] / sums[2]


def header(args, world, train, test):
    """The run's set-up in a few lines (rank 0 prints it)."""
    places = dist_hosts()
    hosts = sorted({host for host, _ in places})
    return (f"hpcgrad DDP job: {counted(world, 'rank')} on {counted(len(hosts), 'node')}; model {args.model}; "
            f"global batch {args.batch_size * world} ({args.batch_size} per rank); lr {args.lr}; "
            f"momentum {args.momentum}; epochs {args.epochs}\n"
            f"data: {len(train)} train / {len(test)} test samples; MPI: "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}; CUDA-aware: {cuda_aware_mpi()[0]}; "
            f"checkpoints and metrics.jsonl in {args.checkpoint_dir}\n"
            f"ranks: {rank_places(places)}\n"
            f"arguments: {' '.join(f'{k}={v}' for k, v in sorted(vars(args).items()))}")


def rank_places(places, most=64):
    """'0 node1 pid 11, 1 node1 pid 12, ...': a launcher that reports a dead process by host and
    pid only (MPICH's hydra on SIGKILL) is traced back to its rank with this line."""
    shown = ", ".join(f"{rank} {host} pid {pid}" for rank, (host, pid) in enumerate(places[:most]))
    return shown + (f", ... ({len(places) - most} more)" if len(places) > most else "")


def check_setup(args, world, train):
    """What makes this run impossible, found before training (the same on every rank), or None."""
    per_rank = len(train) // world
    if args.batch_size > per_rank:
        return (f"--batch-size {args.batch_size} is larger than each rank's share of the "
                f"{len(train)} training samples ({per_rank} at {world} ranks); use at most "
                f"{per_rank}")
    return unwritable(args.checkpoint_dir)


def ddp_summary(model):
    """One line from DDP's logging data (PyTorch's _get_ddp_logging_data), after some steps."""
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]
    unused = ", ".join(data["unused_parameter_names"]) or "none"
    return (f"DDP: {data['num_buckets']} bucket(s) of {', '.join(f'{b / 2**20:.3f}' for b in sizes)} MB"
            f" ({'rebuilt in gradient order' if data['has_rebuilt_buckets'] else 'not rebuilt'}), "
            f"comm hook {data['comm_hook']}, unused parameters {unused}; per step on rank 0: "
            f"backward {data['avg_backward_compute_time'] / 1e6:.1f} ms, all-reduce "
            f"{data['avg_backward_comm_time'] / 1e6:.1f} ms, overlapped "
            f"{data['avg_backward_compute_comm_overlap_time'] / 1e6:.1f} ms")


def dist_hosts():
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (os.uname().nodename, os.getpid()))
    return everyone


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.checkpoint_dir, "last.npz")
    marker = os.path.join(args.checkpoint_dir, PREEMPTED)
    step, start_epoch, skip = 0, 0, 0
    if args.resume:
        # A checkpoint that cannot continue this run is refused before the model and the data
        # are made (load_digits imports scikit-learn: seconds per rank).
        meta = resume_extra(path)
        step, start_epoch, skip = meta["step"], meta["epoch"], meta["batches_done"]
        saved_world = int(meta.get("world_size", world))
        stop_if_any(f"{path} was saved by {saved_world} ranks in the middle of epoch "
                    f"{start_epoch + 1} (after {skip} of its steps); at {world} ranks the epoch's "
                    f"shards differ, so it cannot continue exactly. Resume with {saved_world} "
                    f"ranks, or start a new run (another --checkpoint-dir)"
                    if saved_world != world and skip else None, PROG, "checking the checkpoint")
    hg.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    train, test = load_digits("train"), load_digits("test")
    sampler = DistributedSampler(train, seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test, batch_size=256, sampler=EvaluationShard(len(test), rank, world))
    stop_if_any(check_setup(args, world, train), PROG, "checking the set-up")
    lines = header(args, world, train, test)
    if rank == 0:
        print(lines, flush=True)
    if args.resume:
        problem = None
        try:
            checkpoint.load(path, model, optimizer)
        except checkpoint.CheckpointError as exc:
            problem = str(exc)
        stop_if_any(problem, PROG, "loading the checkpoint", status=1)
        if saved_world != world and rank == 0:
            print(f"note: {path} was saved by {saved_world} ranks; continuing at {world} from the "
                  f"start of epoch {start_epoch + 1} (global batch now "
                  f"{args.batch_size * world})", flush=True)
        if rank == 0:
            print(f"resumed from {path}: epoch {start_epoch}, step {step}", flush=True)
        if start_epoch >= args.epochs:
            if rank == 0:
                print(f"the run in {args.checkpoint_dir} is complete ({start_epoch} of "
                      f"{args.epochs} epochs); nothing to train. Raise --epochs to train on, "
                      "or use a new --checkpoint-dir for a new run", flush=True)
                if os.path.exists(marker):
                    os.remove(marker)
            return 0
    if rank == 0 and os.path.exists(marker):
        os.remove(marker)  # this run continues the preempted one
    preemption = Preemption()
    metrics = MetricsLog(args.checkpoint_dir, rank, tensorboard=args.tensorboard,
                         purge_step=step or None)

    def save(epoch, batches_done):
        problem = None
        if rank == 0:
            try:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                checkpoint.save(path, model, optimizer, step=step, epoch=epoch,
                                batches_done=batches_done, world_size=world, args=vars(args))
            except (checkpoint.CheckpointError, OSError) as exc:
                problem = str(exc)
        # Nobody reads or overwrites it before it is complete; a failure ends every rank.
        stop_if_any(problem, PROG, "saving the checkpoint", status=1)

    progress = None
    # A bar only on a terminal: in a SLURM log its carriage returns are noise.
    if rank == 0 and not args.no_progress and sys.stdout.isatty():
        from tqdm import tqdm
        progress = tqdm(total=args.epochs * len(train_loader), initial=step, unit="step",
                        dynamic_ncols=True, file=sys.stdout)
    started = time.perf_counter()
    try:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            losses, samples, epoch_started = [], 0, time.perf_counter()
            for batch, (images, labels) in enumerate(train_loader):
                if batch < skip:
                    continue  # already trained before the checkpoint we resumed from
                with TIMELINE.span("forward", "step", step=step + 1):
                    loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                with TIMELINE.span("backward", "step", step=step + 1):
                    loss.backward()
                with TIMELINE.span("optimizer step", "step", step=step + 1):
                    optimizer.step()
                step += 1
                losses.append(loss.item())
                samples += len(labels.array)
                metrics.write("step", step, epoch, time.perf_counter() - started, loss=losses[-1])
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
                stop = preemption.agreed() or (args.max_steps and step >= args.max_steps)
                if stop or (args.checkpoint_every and step % args.checkpoint_every == 0):
                    with TIMELINE.span("checkpoint", "step", step=step):
                        save(epoch, batch + 1)
                if stop:
                    status = stop_status(preemption.stopped_by)
                    if rank == 0:
                        if status or not args.max_steps or step < args.max_steps:
                            open(marker, "w").close()  # requeue me (slurm/train_ddp.sbatch)
                        print(stopped_line(step, path, preemption.stopped_by), flush=True)
                    finish_timeline(dist.barrier, rank)
                    return status
            elapsed = time.perf_counter() - epoch_started
            # Loss and samples of the steps this run made: after a mid-epoch resume, a part.
            totals = np.array([sum(losses), len(losses), samples, elapsed])
            dist.all_reduce(totals[:3])
            train_loss = totals[0] / max(totals[1], 1)
            samples_per_s = totals[2] / elapsed if elapsed > 0 else float("nan")
            test_loss, accuracy = evaluate(model, test_loader)
            with TIMELINE.span("checkpoint", "step", step=step):
                save(epoch + 1, 0)
            partial = "" if skip == 0 else f" (steps {skip + 1}-{len(train_loader)} only: resumed)"
            skip = 0
            metrics.write("epoch", step, epoch + 1, time.perf_counter() - started, loss=train_loss,
                          test_loss=test_loss, test_accuracy=accuracy,
                          samples_per_s=samples_per_s, epoch_seconds=elapsed)
            if rank == 0:
                message = (f"epoch {epoch + 1}/{args.epochs}  loss {train_loss:.4f}{partial}  "
                           f"test loss {test_loss:.4f}  test accuracy {accuracy:.4f}  "
                           f"{elapsed:.2f} s  {samples_per_s:,.0f} samples/s  "
                           f"({time.perf_counter() - started:.1f} s)")
                (progress.write if progress is not None else print)(message, flush=True)
                if epoch == start_epoch:
                    (progress.write if progress is not None else print)(ddp_summary(model),
                                                                       flush=True)
    finally:
        metrics.close()
        if progress is not None:
            progress.close()
    finish_timeline(dist.barrier, rank)  # every rank's part, merged by rank 0
    return 0


if __name__ == "__main__":
    status = main()
    Preemption.ignore_from_now()
    exit_together(status)  # every return of main is the same on every rank
