"""hpcgrad.training.Loop (Note [One training loop]) with a toy job: every step once across stops
and resumes, the stop at an epoch's end after its report, preemption's status and marker."""

import argparse
import json
import os
import signal

import pytest

import hpcgrad.distributed as dist
from hpcgrad import checkpoint, nn, optim
from hpcgrad.training.loop import CHECKPOINT, PREEMPTED, Job, Loop


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


def run(run_dir, job, epochs=3, resume=False, max_steps=0):
    args = argparse.Namespace(epochs=epochs, checkpoint_dir=run_dir, checkpoint_every=0,
                              resume=resume, max_steps=max_steps, no_progress=True,
                              tensorboard=False)
    model = nn.Linear(2, 1)
    loop = Loop(job, args, model, optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=4)
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
