"""hpcgrad.training.Loop (Note [One training loop]) with a toy job: every step once across stops
and resumes, the stop at an epoch's end after its report, preemption's status and marker; a
pipeline's hooks: multi-part commits (each rank its own state), the stop agreed one step late,
begin/finish, an epoch loss over the whole epoch; start, the start of every job's main."""

import argparse
import json
import os
import signal

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad import checkpoint, nn, optim
from hpcgrad.data import TensorDataset
from hpcgrad.training.loop import (CHECKPOINT, PREEMPTED, Commits, Job, LastFile, LatePreemption,
                                   Loop, loaders, start)


class Counting(Job):
    """Four batches an epoch; a step's loss is its number; remembers the steps it ran."""

    prog = "test_training"

    def __init__(self, signal_at=None):
        self.ran, self.restored, self.signal_at = [], None, signal_at

    def batches(self, epoch):
        return [(epoch, b) for b in range(4)]

    def step(self, batch, step):
        self.ran.append((batch, step))
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's notice before the time limit
        return float(step), 2, {"twice": 2.0 * step}

    def end_epoch(self, epoch):
        return {"test_accuracy": 0.5}, f"epoch {epoch} ended"

    def checkpoint_state(self):
        return {"ran": len(self.ran)}

    def restore(self, meta):
        self.restored = meta["ran"]


@pytest.fixture
def run_dir(tmp_path):
    """One directory for every rank (rank 0's), with the process group up; the stop signals'
    handlers restored afterwards (the loop installs its own)."""
    dist.init_process_group()
    shared = [str(tmp_path)]
    dist.broadcast_object_list(shared, src=0)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)}
    yield shared[0]
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    dist.barrier()


def arguments(run_dir, epochs=3, resume=False, max_steps=0):
    return argparse.Namespace(epochs=epochs, checkpoint_dir=run_dir, checkpoint_every=0,
                              resume=resume, max_steps=max_steps, no_progress=True,
                              tensorboard=False)


def run(run_dir, job, epochs=3, resume=False, max_steps=0, checkpoints=None):
    args = arguments(run_dir, epochs, resume, max_steps)
    model = nn.Linear(2, 1)
    loop = Loop(job, args, model, optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4,
                checkpoints=checkpoints)
    return loop, loop.run()


def records(run_dir, kind):
    lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.mpi(min_size=1)
def test_a_whole_run(run_dir):
    job = Counting()
    loop, status = run(run_dir, job)
    assert status == 0 and loop.finished and loop.step == 12
    assert [step for _, step in job.ran] == list(range(1, 13))
    assert [batch for batch, _ in job.ran] == [(e, b) for e in range(3) for b in range(4)]
    if dist.get_rank() == 0:
        epochs = records(run_dir, "epoch")
        assert [e["step"] for e in epochs] == [4, 8, 12]
        assert [e["loss"] for e in epochs] == [2.5, 6.5, 10.5]  # the mean of the step numbers
        assert all(e["samples_per_s"] > 0 and e["test_accuracy"] == 0.5 for e in epochs)
        assert [r["twice"] for r in records(run_dir, "step")] == [2.0 * s for s in range(1, 13)]
    meta = checkpoint.read_extra(os.path.join(run_dir, CHECKPOINT))
    assert (meta["step"], meta["epoch"], meta["batches_done"], meta["ran"]) == (12, 3, 0, 12)


@pytest.mark.mpi(min_size=1)
def test_stop_mid_epoch_and_resume_runs_every_step_once(run_dir):
    first = Counting()
    loop, status = run(run_dir, first, max_steps=6)
    assert status == 0 and not loop.finished and loop.step == 6
    assert not os.path.exists(os.path.join(run_dir, PREEMPTED))  # --max-steps is no preemption
    meta = checkpoint.read_extra(os.path.join(run_dir, CHECKPOINT))
    assert (meta["step"], meta["epoch"], meta["batches_done"]) == (6, 1, 2)
    second = Counting()
    loop, status = run(run_dir, second, resume=True)
    assert status == 0 and loop.finished and second.restored == 6
    assert [step for _, step in second.ran] == list(range(7, 13))
    assert second.ran[0][0] == (1, 2)  # epoch 1's first two batches were skipped


@pytest.mark.mpi(min_size=1)
def test_a_stop_at_an_epochs_last_step_reports_the_epoch_first(run_dir):
    loop, status = run(run_dir, Counting(), max_steps=4)
    assert status == 0 and loop.step == 4
    meta = checkpoint.read_extra(os.path.join(run_dir, CHECKPOINT))
    assert (meta["step"], meta["epoch"], meta["batches_done"]) == (4, 1, 0)
    if dist.get_rank() == 0:
        assert [e["step"] for e in records(run_dir, "epoch")] == [4]
    again = Counting()
    run(run_dir, again, resume=True)
    assert [step for _, step in again.ran] == list(range(5, 13))


@pytest.mark.mpi(min_size=1)
def test_a_preemption_notice_checkpoints_marks_and_exits_with_128_plus_the_signal(run_dir):
    job = Counting(signal_at=3)
    loop, status = run(run_dir, job)
    assert status == 128 + signal.SIGUSR1 and loop.step == 3
    if dist.get_rank() == 0:
        assert os.path.exists(os.path.join(run_dir, PREEMPTED))
    meta = checkpoint.read_extra(os.path.join(run_dir, CHECKPOINT))
    assert (meta["step"], meta["batches_done"]) == (3, 3)
    dist.barrier()
    resumed = Counting()
    loop, status = run(run_dir, resumed, resume=True)
    assert status == 0 and [s for _, s in resumed.ran] == list(range(4, 13))
    assert not os.path.exists(os.path.join(run_dir, PREEMPTED))  # the resumed run removed it


@pytest.mark.mpi(min_size=1)
def test_a_complete_run_has_nothing_to_train(run_dir, capsys):
    run(run_dir, Counting(), epochs=1)
    job = Counting()
    loop, status = run(run_dir, job, epochs=1, resume=True)
    assert status == 0 and job.ran == [] and not loop.finished
    if dist.get_rank() == 0:
        assert "is complete (1 of 1 epochs); nothing to train" in capsys.readouterr().out


class Staged(Counting):
    """Counting as a pipeline runs: the loss known on the last rank only (0 elsewhere), each
    rank's own state in its part of a commit, the stop agreed one step late, the epoch's loss
    the job's own, kept across a resume; counts begin and finish."""

    preemption = LatePreemption

    def __init__(self, signal_at=None):
        super().__init__(signal_at)
        self.rank, self.last = dist.get_rank(), dist.get_world_size() - 1
        self.begun = self.finished = 0
        self.loss_sum = 0.0  # the epoch's, on the last rank

    def begin(self):
        self.begun += 1

    def finish(self):
        self.finished += 1

    def step(self, batch, step):
        self.ran.append((batch, step))
        if step == self.signal_at and self.rank == self.last:  # one rank alone
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.rank != self.last:
            return 0.0, 0, {}
        self.loss_sum += step
        return float(step), 2, {}

    def end_epoch(self, epoch):
        figure = [self.loss_sum]
        dist.broadcast_object_list(figure, src=self.last)
        self.loss_sum = 0.0
        return {"loss": 1000.0 + figure[0]}, ""

    def checkpoint_state(self):
        return {"rank": self.rank, "ran": len(self.ran), "loss_sum": self.loss_sum}

    def restore(self, meta):
        assert meta["rank"] == self.rank  # this rank's own part
        self.restored, self.loss_sum = meta["ran"], meta["loss_sum"]


def commits(run_dir):
    return Commits(run_dir, "test_training")


@pytest.mark.mpi(min_size=1)
def test_late_agreement_stops_every_rank_one_step_later_and_commits_resume_exactly(run_dir,
                                                                                   capsys):
    first = Staged(signal_at=2)  # the last rank alone: its agreement is waited for after step 3
    loop, status = run(run_dir, first, checkpoints=commits(run_dir))
    assert status == 128 + signal.SIGUSR1 and loop.step == 3 and not loop.finished
    assert [s for _, s in first.ran] == [1, 2, 3] and (first.begun, first.finished) == (1, 0)
    assert os.path.basename(loop.checkpoints.path).startswith("commit-")
    if dist.get_rank() == 0:
        assert os.path.exists(os.path.join(run_dir, PREEMPTED))
        assert f"stopped at step 3 by SIGUSR1 (exit status 138); checkpoint " \
               f"{loop.checkpoints.path}" in capsys.readouterr().out
        steps = records(run_dir, "step")  # every step once, the last rank's loss
        assert [(r["step"], r["loss"]) for r in steps] == [(s, float(s)) for s in (1, 2, 3)]
    dist.barrier()
    second = Staged()
    loop, status = run(run_dir, second, resume=True, checkpoints=commits(run_dir))
    assert status == 0 and loop.finished and second.restored == 3
    assert [s for _, s in second.ran] == list(range(4, 13))
    assert (second.begun, second.finished) == (1, 1)
    if dist.get_rank() == 0:
        out = capsys.readouterr().out
        assert "resumed from " in out and "commit-" in out and "epoch 0, step 3" in out
        assert "(resumed after step 3 of 4: figures over the whole epoch" in out
        epochs = records(run_dir, "epoch")  # the job's loss, over the whole of epoch 1
        assert [(e["step"], e["loss"]) for e in epochs] == [
            (4, 1000.0 + 1 + 2 + 3 + 4), (8, 1000.0 + 5 + 6 + 7 + 8), (12, 1000.0 + 9 + 10 + 11 + 12)]
        assert [r["step"] for r in records(run_dir, "step")] == list(range(1, 13))


@pytest.mark.mpi(min_size=1)
def test_a_late_agreement_settles_at_max_steps_and_at_an_epochs_end(run_dir):
    job = Staged()
    loop, status = run(run_dir, job, max_steps=6, checkpoints=commits(run_dir))
    assert status == 0 and loop.step == 6
    assert not os.path.exists(os.path.join(run_dir, PREEMPTED))
    if dist.get_rank() == 0:  # nothing left in flight: steps 4 and 6 recorded
        assert [r["step"] for r in records(run_dir, "step")] == list(range(1, 7))
        assert [e["step"] for e in records(run_dir, "epoch")] == [4]


@pytest.mark.mpi(min_size=1)
def test_nothing_to_train_begins_nothing(run_dir):
    run(run_dir, Staged(), epochs=1, checkpoints=commits(run_dir))
    job = Staged()
    loop, status = run(run_dir, job, epochs=1, resume=True, checkpoints=commits(run_dir))
    assert status == 0 and job.ran == [] and (job.begun, job.finished) == (0, 0)


@pytest.mark.mpi(min_size=1)
def test_start_checks_the_saved_run_before_the_job_makes_its_model(run_dir):
    run(run_dir, Counting(), max_steps=2)
    seen = []
    rank, world, store = start(arguments(run_dir, resume=True), "test_training",
                               lambda meta, path, size: seen.append((meta["step"], path, size)))
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    assert isinstance(store, LastFile) and store.path == os.path.join(run_dir, CHECKPOINT)
    assert seen == [(2, store.path, world)]
    assert start(arguments(run_dir), "test_training", lambda *saved: 1 / 0)[2].path == store.path


@pytest.mark.mpi(min_size=1)
def test_loaders_shard_training_and_count_every_test_sample_once():
    dist.init_process_group()
    args = argparse.Namespace(seed=0, batch_size=3)
    train = TensorDataset(np.arange(20.0))
    test = TensorDataset(np.arange(7.0))
    sampler, train_loader, test_loader = loaders(args, train, test)
    assert len(sampler) == -(-20 // dist.get_world_size())
    seen = [[float(x) for (batch,) in test_loader for x in batch.array]]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen[0])
    assert sorted(x for part in everyone for x in part) == list(np.arange(7.0))
