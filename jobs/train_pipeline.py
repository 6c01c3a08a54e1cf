"""Pipeline-parallel training of an MLP on scikit-learn's digits: one stage per rank, distributed autograd.

    mpiexec -n 3 python jobs/train_pipeline.py                 # 2 to 4 ranks; a few seconds
    mpiexec -n 3 python jobs/train_pipeline.py --resume        # continue from checkpoints-pipeline/

The MLP 64-128-128-64-10 (ReLU between layers) is cut into one contiguous stage per rank; each
rank owns its stage's parameters. Per batch, inside one distributed-autograd context per rank:
rank 0 feeds the images to its stage and ``dist_autograd.send``s the activations to rank 1,
which ``recv``s them, applies its stage and sends on; the last rank computes the cross-entropy
loss and runs ``dist_autograd.backward``, which carries the gradients back rank by rank; the
other ranks ``wait_for_backward``. Every rank then steps its own parameters with a local SGD
from ``get_gradients(ctx)`` (``.grad`` is never written by distributed autograd). One batch is
in flight at a time (no micro-batch overlap). All ranks shuffle with the same seed, so the last
rank's labels line up with rank 0's images.

Rank 0 prints a header and one line per epoch (train loss and accuracy, test loss and accuracy
over every test sample once, epoch time, samples/s); the figures come from the last rank. It
shows a progress bar on a terminal and appends to <checkpoint-dir>/metrics.jsonl. Every
--checkpoint-every steps and at the end of each epoch the ranks save a multi-part checkpoint
(Note [Multi-part commit] in hpcgrad/training/checkpoint.py): each rank its stage, then rank 0 commits a
manifest naming every stage's file once all are durable; --resume continues from the newest
complete commit, so a job killed at any moment loses at most the steps since it. On SIGTERM,
SIGUSR1 or SIGINT (preemption, Ctrl-C) sent to any rank, all ranks stop at the next step after a
checkpoint, rank 0 leaves <checkpoint-dir>/PREEMPTED and the job exits with 128 + the signal's
number (jobs/job_args.py: the exit statuses); --resume continues exactly. HPCGRAD_TIMELINE=path
records a timeline of every rank.

Note [Pipeline job's learning]
    The first version reached 0.93 test accuracy at epoch 4 and fell to 0.84 at epoch 5 (2
    ranks). The pipeline was not at fault: one process training the same stages on the same
    batches gives the same losses to the last digit. Two things were. (1) PyTorch's default
    Linear initialisation (std 1/sqrt(3 fan_in)) shrinks the signal by about sqrt(6) per
    ReLU layer, so through four layers the logits start near 0 and the loss sits at ln 10 for an
    epoch; only a large step (lr 0.1, momentum 0.9: 1.0 in effect) got out of that plateau.
    (2) That step stayed as large to the last batch, so the final accuracy depended on where
    the last few noisy steps threw the weights (0.93 -> 0.84 -> 0.93 from epoch to epoch).
    Now the layers followed by a ReLU start from He's initialisation (kaiming_normal_, gain
    sqrt(2)), which trains from the first epoch at lr 0.05, and the learning rate follows a
    cosine from --lr down to 0 over the run, so the last epoch refines instead of jumping. Over
    seeds 0-3 at 2 and 3 ranks the last epoch is now within 0.006 of the best (0.964-0.981).
    The rate is a function of the step and --epochs alone, so a resumed run follows the same
    schedule (raising --epochs on resume stretches it: the rate rises again).
"""

import math
import os
import signal
import sys
import time

import numpy as np
from job_args import add_run_arguments, parse_together, real, training_parser

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.nn.functional as F
from hpcgrad import checkpoint, nn, optim
from hpcgrad.comm.mpi import MPI, comm_world, exit_together
from hpcgrad.data import load_digits
from hpcgrad.distributed import rpc
from hpcgrad.training.metrics import MetricsLog
from hpcgrad.nn import init
from hpcgrad.base.timeline import TIMELINE
from hpcgrad.base.timeline import finish as finish_timeline
from hpcgrad.training.loop import (Preemption, counted, stop_if_any, stop_status, unwritable)

WIDTHS = (64, 128, 128, 64, 10)  # 4 Linear layers: one stage each on 4 ranks
PREEMPTED = "PREEMPTED"  # marker file: the last run stopped early and should be resumed
PROG = "train_pipeline.py"


def stage_layers(rank, world):
    """The Linear layers (indices) of ``rank``'s stage: contiguous, as even as possible."""
    layers = len(WIDTHS) - 1
    bounds = np.linspace(0, layers, world + 1).round().astype(int)
    return range(bounds[rank], bounds[rank + 1])


def describe_stage(rank, world):
    """'Linear 64>128, ReLU, Linear 128>128, ReLU': what ``rank``'s stage computes."""
    parts = []
    for i in stage_layers(rank, world):
        parts.append(f"Linear {WIDTHS[i]}>{WIDTHS[i + 1]}")
        if i + 1 < len(WIDTHS) - 1:
            parts.append("ReLU")
    return ", ".join(parts)


def build_stage(rank, world, seed):
    """``rank``'s part of the MLP, initialised from a seed of its own (Note [Pipeline job's
    learning]: He's initialisation before a ReLU, zero biases)."""
    hg.manual_seed(seed * 1000 + rank)
    modules = []
    for i in stage_layers(rank, world):
        linear = nn.Linear(WIDTHS[i], WIDTHS[i + 1])
        relu = i + 1 < len(WIDTHS) - 1
        init.kaiming_normal_(linear.weight, nonlinearity="relu" if relu else "linear")
        init.zeros_(linear.bias)
        modules.append(linear)
        if relu:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def learning_rate(base, step, total):
    """The rate of step ``step`` (0-based) of ``total``: a cosine from ``base`` down to 0."""
    return base * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))


def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0], epochs=5,
                        batch_help="samples per step (every stage sees the whole batch)",
                        lr_help="SGD learning rate at the start; a cosine takes it to 0 at the end",
                        seed_help="seed of the weights and the shuffling")
    p.add_argument("--timeout", type=real("seconds any rank waits for another", 60,
                                          positive=True),
                   default=60, help="seconds any rank waits for another")
    add_run_arguments(p, checkpoint_dir="checkpoints-pipeline",
                      checkpoint_help="the run's commits (commit-*.json) and metrics.jsonl",
                      resume_help="continue from the newest complete commit in <checkpoint-dir> "
                                  "(same number of ranks)")
    return parse_together(p, argv)


class PipelinedPreemption(Preemption):
    """hpcgrad.training's Preemption, agreed one step late: the ranks' agreement (one tiny
    all-reduce per step on the world, which also brings the last rank's step loss to rank 0)
    for step k is waited for after step k + 1 (``exchange``). In a pipeline the ranks finish a
    step at different times, and a blocking agreement had rank 0 spin in MPI_Wait through the
    other stages' backward; on 3 ranks sharing 2 cores that doubled the epoch time. By then
    every rank has posted it, so the wait returns at once. A signal thus stops the job one
    step later, on every rank alike."""

    def __init__(self):
        super().__init__()
        self._pending = None  # (step, values, work) of the last step's all-reduce

    def exchange(self, step, loss):
        """Post ``step``'s agreement (this rank's largest stop signal; the last rank's loss,
        the others' 0: a loss is >= 0, so the maximum is the last rank's) and return the
        previous one's (step, the largest signal any rank received or 0, loss), or None.
        Every rank calls it."""
        values = np.array([float(self.signum), loss])
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._pending = self.settle(), (step, values, work)
        return previous

    def settle(self):
        """Wait for the agreement in flight, if any: (step, signal or 0, loss), or None."""
        if self._pending is None:
            return None
        step, values, work = self._pending
        self._pending = None
        work.wait()
        signum = int(values[0])
        self.stopped_by = max(self.stopped_by, signum)
        return step, signum, float(values[1])


def train_step(stage, optimizer, images, labels, rank, last, timeout, step):
    """One batch through the pipeline and back; returns (loss, correct) on the last rank."""
    with dist_autograd.context() as ctx:
        with TIMELINE.span("forward", "step", step=step):
            h = images if rank == 0 else dist_autograd.recv(rank - 1, timeout=timeout)
            out = stage(h)
            if rank < last:
                dist_autograd.send(out, rank + 1)
            else:
                loss = F.cross_entropy(out, labels)
        result = None
        with TIMELINE.span("backward", "step", step=step):
            if rank < last:
                dist_autograd.wait_for_backward(ctx, timeout=timeout)
            else:
                dist_autograd.backward(ctx, [loss], timeout=timeout)
                result = (loss.item(), int((out.array.argmax(1) == labels.array).sum()))
        grads = dist_autograd.get_gradients(ctx)
    with TIMELINE.span("optimizer step", "step", step=step):
        for p in stage.parameters():
            p.grad = grads.get(p)
        optimizer.step()
        for p in stage.parameters():
            p.grad = None
    return result


def evaluate(stage, images, labels, rank, last, timeout):
    """(test loss, accuracy) over every test sample once, through the pipeline without a
    context (nothing to differentiate): on the last rank; None elsewhere."""
    with hg.no_grad():
        h = images if rank == 0 else dist_autograd.recv(rank - 1, timeout=timeout)
        out = stage(h)
        if rank < last:
            dist_autograd.send(out, rank + 1)
            return None
        loss = F.cross_entropy(out, labels).item()
    return loss, float((out.array.argmax(1) == labels.array).mean())


def header(args, world, train_size, test_size, steps_per_epoch):
    """The run's set-up in a few lines (rank 0 prints it)."""
    hosts = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename)
    stages = "; ".join(f"rank {r}: {describe_stage(r, world)}" for r in range(world))
    return (f"hpcgrad pipeline job: {counted(world, 'rank')} on {counted(len(set(hosts)), 'node')}, one stage each; "
            f"batch {args.batch_size}; lr {args.lr} (cosine to 0 over "
            f"{args.epochs * steps_per_epoch} steps); momentum {args.momentum}; "
            f"epochs {args.epochs}\n"
            f"stages: {stages}\n"
            f"data: {train_size} train / {test_size} test samples; MPI: "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}; "
            f"checkpoints and metrics.jsonl in {args.checkpoint_dir}\n"
            f"arguments: {' '.join(f'{k}={v}' for k, v in sorted(vars(args).items()))}")


def check_setup(args, train_size):
    """What makes this run impossible, found before training (the same on every rank), or None."""
    if args.batch_size > train_size:
        return (f"--batch-size {args.batch_size} is larger than the {train_size} training "
                f"samples (every stage sees the whole batch); use at most {train_size}")
    return unwritable(args.checkpoint_dir)


def resume_problem(args, world, commit):
    """Why ``commit`` (checkpoint.find_commit's) cannot continue this run, or None."""
    if commit is None:
        legacy = os.path.exists(os.path.join(args.checkpoint_dir, "stage0.npz"))
        hint = (" (its stage<R>.npz files were written by an hpcgrad without commits, which "
                "cannot tell whether they belong together; start afresh)" if legacy else "")
        return (f"--resume: no checkpoint (commit-*.json) in {args.checkpoint_dir}{hint}; run "
                "without --resume first, or point --checkpoint-dir at a pipeline run")
    saved_world = commit.world_size
    if saved_world != world:
        layers = [list(stage_layers(r, saved_world)) for r in range(saved_world)] \
            if 2 <= saved_world <= len(WIDTHS) - 1 else "?"
        return (f"{args.checkpoint_dir} holds a pipeline of {saved_world} stages (saved by "
                f"{saved_world} ranks; Linear layers per rank {layers}), but this job has "
                f"{world} ranks, whose stages hold other layers: it cannot continue. Resume "
                f"with {saved_world} ranks (mpiexec -n {saved_world} ... --resume), or start "
                f"fresh at {world}: without --resume and with another --checkpoint-dir")
    return None


def resumable_commit(args, world):
    """Every rank: the newest complete commit, which can continue this run, or every rank
    exits together with one line on rank 0 (status 2 where there is nothing to resume at this
    size, 1 where the checkpoints are damaged)."""
    commit, problem = None, None
    try:
        commit = checkpoint.find_commit(args.checkpoint_dir)
    except checkpoint.CheckpointError as exc:
        problem = str(exc)
    stop_if_any(problem, PROG, "reading the checkpoint", status=1)
    stop_if_any(resume_problem(args, world, commit), PROG, "checking the checkpoint")
    return commit


def resume(args, commit, rank, stage, optimizer):
    """Every rank restores its stage from ``commit`` (resumable_commit's); returns its
    ``extra`` values, or exits every rank together with one line on rank 0 (status 1)."""
    meta, problem = None, None
    try:
        meta = checkpoint.load_commit(commit, stage, optimizer)
    except checkpoint.CheckpointError as exc:
        problem = str(exc)
    stop_if_any(problem, PROG, "loading the checkpoint", status=1)
    if rank == 0:
        where = os.path.join(args.checkpoint_dir, commit.name)
        for skipped in commit.skipped:
            print(f"note: skipped a newer commit, {skipped}", flush=True)
        newer = checkpoint.newer_uncommitted_steps(args.checkpoint_dir, commit)
        if newer:
            print(f"note: ignored the parts of step(s) {', '.join(map(str, newer))}: a save "
                  "stopped before every stage had committed it", flush=True)
        print(f"resumed from {where}: epoch {meta['epoch']}, step {meta['step']}", flush=True)
    return meta


def main(argv=None):
    args = parse_args(argv)
    rank, world = comm_world().Get_rank(), comm_world().Get_size()
    if not 2 <= world <= len(WIDTHS) - 1:
        if rank == 0:
            print(f"{PROG}: error: run with 2 to {len(WIDTHS) - 1} ranks (one stage "
                  f"each), e.g. mpiexec -n 3 python jobs/train_pipeline.py; got {world}",
                  file=sys.stderr, flush=True)
        return 2  # every rank: the world size is the same everywhere
    # The world group carries the barriers and the per-step agreement; the RPC agent (started
    # below) talks on a communicator of its own.
    dist.init_process_group(timeout=args.timeout)
    last = world - 1
    commit = None
    if args.resume:
        # A checkpoint that cannot continue this run is refused before the data are loaded
        # (load_digits imports scikit-learn: seconds per rank); a directory it cannot use
        # (unreadable too) as before.
        stop_if_any(unwritable(args.checkpoint_dir), PROG, "checking the set-up")
        commit = resumable_commit(args, world)
    train, test = load_digits("train", flatten=True), load_digits("test", flatten=True)
    train_x, train_y = (t.array for t in train.tensors)
    test_x, test_y = (t.array for t in test.tensors)
    steps_per_epoch = -(-len(train_y) // args.batch_size)
    stop_if_any(check_setup(args, len(train_y)), PROG, "checking the set-up")
    lines = header(args, world, len(train_y), len(test_y), steps_per_epoch)
    if rank == 0:
        print(lines, flush=True)
    stage = build_stage(rank, world, args.seed)
    optimizer = optim.SGD(stage.parameters(), lr=args.lr, momentum=args.momentum)
    marker = os.path.join(args.checkpoint_dir, PREEMPTED)
    step, start_epoch, skip = 0, 0, 0
    sums = np.zeros(3)  # the last rank's loss sum, correct and samples of the epoch so far
    if args.resume:
        meta = resume(args, commit, rank, stage, optimizer)
        step, start_epoch, skip = meta["step"], meta["epoch"], meta["batches_done"]
        sums[:] = meta.get("epoch_sums", sums)
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
    rpc.init_rpc(f"stage{rank}")
    preemption = PipelinedPreemption()
    metrics = MetricsLog(args.checkpoint_dir, rank, tensorboard=args.tensorboard,
                         purge_step=step or None)
    total_steps = args.epochs * steps_per_epoch

    def save(epoch, batches_done):
        """A multi-part commit (collective); a failure, found by every rank alike, ends the
        job with one line (status 1), the last commit standing."""
        with TIMELINE.span("checkpoint", "step", step=step):
            extra = {"epoch_sums": sums.tolist()} if rank == last else {}
            try:
                return checkpoint.save_parts(
                    args.checkpoint_dir, stage, optimizer, step=step, epoch=epoch,
                    batches_done=batches_done, world_size=world,
                    layers=list(stage_layers(rank, world)), args=vars(args), **extra)
            except checkpoint.CheckpointError as exc:
                failed = str(exc)
        if rank == 0:
            print(f"{PROG}: error: {failed}", file=sys.stderr, flush=True)
        exit_together(1)  # every rank raised: as a stop, without rpc.shutdown

    progress = None
    # A bar only on a terminal: in a SLURM log its carriage returns are noise.
    if rank == 0 and not args.no_progress and sys.stdout.isatty():
        from tqdm import tqdm
        progress = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True,
                        file=sys.stdout)
    started = time.perf_counter()
    try:
        for epoch in range(start_epoch, args.epochs):
            order = np.random.default_rng(args.seed + epoch).permutation(len(train_y))
            samples, epoch_started = 0, time.perf_counter()
            resumed_at = skip
            for batch, start in enumerate(range(0, len(order), args.batch_size)):
                if batch < skip:
                    continue  # already trained before the checkpoint we resumed from
                rows = order[start:start + args.batch_size]
                x = hg.tensor(train_x[rows]) if rank == 0 else None
                y = hg.tensor(train_y[rows]) if rank == last else None
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(args.lr, step, total_steps)
                result = train_step(stage, optimizer, x, y, rank, last, args.timeout, step + 1)
                step += 1
                samples += len(rows)
                if result is not None:
                    sums += [result[0] * len(rows), result[1], len(rows)]
                agreed = [preemption.exchange(step, 0.0 if result is None else result[0])]
                stop = bool(args.max_steps and step >= args.max_steps)
                if stop or (agreed[0] and agreed[0][1]) or batch + 1 == steps_per_epoch:
                    agreed.append(preemption.settle())  # this step's too: none left in flight
                for done in filter(None, agreed):
                    stop = stop or bool(done[1])
                    metrics.write("step", done[0], epoch, time.perf_counter() - started,
                                  loss=done[2])
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(epoch=epoch, loss=f"{done[2]:.3f}")
                committed = None
                if stop or (args.checkpoint_every and step % args.checkpoint_every == 0):
                    committed = save(epoch, batch + 1)
                if stop:
                    status = stop_status(preemption.stopped_by)
                    if rank == 0:
                        if status or not args.max_steps or step < args.max_steps:
                            open(marker, "w").close()  # the next run should --resume
                        why = (f" by {signal.Signals(preemption.stopped_by).name} (exit status "
                               f"{status})" if status else "")
                        print(f"\nstopped at step {step}{why}; checkpoint "
                              f"{os.path.join(args.checkpoint_dir, committed)}; continue with "
                              "--resume", flush=True)
                    finish_timeline(dist.barrier, rank)
                    return status
            elapsed = time.perf_counter() - epoch_started
            figures = evaluate(stage, hg.tensor(test_x) if rank == 0 else None,
                               hg.tensor(test_y) if rank == last else None, rank, last,
                               args.timeout)
            if rank == last:  # the figures travel to rank 0, which reports
                dist_autograd.send(hg.tensor([sums[0] / sums[2], sums[1] / sums[2], *figures,
                                              elapsed]), 0)
            sums[:] = 0
            save(epoch + 1, 0)
            skip = 0
            if rank == 0:
                train_loss, train_accuracy, test_loss, accuracy, elapsed = \
                    dist_autograd.recv(last, timeout=args.timeout).array.tolist()
                samples_per_s = samples / elapsed if elapsed > 0 else float("nan")
                metrics.write("epoch", step, epoch + 1, time.perf_counter() - started,
                              loss=train_loss, train_accuracy=train_accuracy,
                              test_loss=test_loss, test_accuracy=accuracy,
                              samples_per_s=samples_per_s, epoch_seconds=elapsed)
                resumed = (f" (resumed after step {resumed_at} of {steps_per_epoch}: figures "
                           "over the whole epoch, time over this run's part)"
                           if resumed_at else "")
                message = (f"epoch {epoch + 1}/{args.epochs}  loss {train_loss:.4f}  train "
                           f"accuracy {train_accuracy:.4f}  test loss {test_loss:.4f}  test "
                           f"accuracy {accuracy:.4f}  {elapsed:.2f} s  {samples_per_s:,.0f} "
                           f"samples/s  ({time.perf_counter() - started:.1f} s){resumed}")
                (progress.write if progress is not None else print)(message, flush=True)
    finally:
        metrics.close()
        if progress is not None:
            progress.close()
    rpc.shutdown()
    finish_timeline(dist.barrier, rank)  # every rank's part, merged by rank 0
    return 0


if __name__ == "__main__":
    status = main()
    Preemption.ignore_from_now()
    exit_together(status)  # every return of main is the same on every rank
